//! The class rules of the mock RM: which parent each object class may be allocated under (device under
//! the client, subdevice / VA space / channel group / memory under a device, channel under a channel
//! group, compute and copy engines under a channel, ...), and which classes hold memory.

use baton_nvidia::class;

/// The role an object plays as a parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The client itself (`hObjectParent == hRoot`).
    Client,
    /// `NV01_DEVICE_0`.
    Device,
    /// `NV20_SUBDEVICE_0`.
    Subdevice,
    /// `KEPLER_CHANNEL_GROUP_A`.
    ChannelGroup,
    /// A GPFIFO channel.
    Channel,
    /// Anything else.
    Other,
}

/// Which parents a class accepts; `None` when the mock does not know the class.
pub fn allowed_parents(class_id: u32) -> Option<&'static [Role]> {
    use Role::*;
    const DEVICE_LEVEL: &[Role] = &[Device, Subdevice];
    const ANY: &[Role] = &[Client, Device, Subdevice, ChannelGroup, Channel, Other];
    Some(match class_id {
        class::NV01_DEVICE_0 | class::NV01_MEMORY_DEVICELESS => &[Client],
        class::NV20_SUBDEVICE_0 | class::FERMI_VASPACE_A | class::KEPLER_CHANNEL_GROUP_A => {
            &[Device]
        }
        class::FERMI_CONTEXT_SHARE_A => &[ChannelGroup],
        class::NV01_EVENT
        | class::NV01_EVENT_OS_EVENT
        | class::NV01_EVENT_KERNEL_CALLBACK
        | class::NV01_EVENT_KERNEL_CALLBACK_EX => ANY,
        class::VOLTA_USERMODE_A
        | class::TURING_USERMODE_A
        | class::AMPERE_USERMODE_A
        | class::HOPPER_USERMODE_A
        | class::BLACKWELL_USERMODE_A
        | class::GT200_DEBUGGER
        | class::MAXWELL_PROFILER_DEVICE
        | class::MMU_FAULT_BUFFER
        | class::ACCESS_COUNTER_NOTIFY_BUFFER => &[Subdevice],
        c if holds_memory(c) => DEVICE_LEVEL,
        c if class::is_channel(c) => &[ChannelGroup, Device],
        c if class::is_compute(c) || class::is_copy_engine(c) => &[Channel],
        _ => return None,
    })
}

/// Whether objects of this class hold memory whose size the mock accounts.
pub fn holds_memory(class_id: u32) -> bool {
    class::is_memory(class_id)
        || matches!(
            class_id,
            class::NV01_MEMORY_LOCAL_PRIVILEGED
                | class::NV01_MEMORY_VIRTUAL
                | class::NV01_MEMORY_SYSTEM_OS_DESCRIPTOR
                | class::NV01_MEMORY_LOCAL_PHYSICAL
        )
}

/// The role an object of `class_id` plays as a parent.
pub fn role_of(class_id: u32) -> Role {
    match class_id {
        class::NV01_DEVICE_0 => Role::Device,
        class::NV20_SUBDEVICE_0 => Role::Subdevice,
        class::KEPLER_CHANNEL_GROUP_A => Role::ChannelGroup,
        c if class::is_channel(c) => Role::Channel,
        _ => Role::Other,
    }
}
