//! RM object classes (`hClass` of `NV_ESC_RM_ALLOC`), their names and the predicates the tracer and
//! ledger need.
//!
//! Source: `src/common/sdk/nvidia/inc/class/cl*.h`.

/// Root client (privileged).
pub const NV01_ROOT: u32 = 0x0;
/// Root client (non-privileged).
pub const NV01_ROOT_NON_PRIV: u32 = 0x1;
/// Root client: `NV_ESC_RM_ALLOC` turns every root class into this one.
pub const NV01_ROOT_CLIENT: u32 = 0x41;
/// Event.
pub const NV01_EVENT: u32 = 0x5;
/// Event with a kernel callback.
pub const NV01_EVENT_KERNEL_CALLBACK: u32 = 0x78;
/// Event signalled through an OS event (fd).
pub const NV01_EVENT_OS_EVENT: u32 = 0x79;
/// Event with an extended kernel callback.
pub const NV01_EVENT_KERNEL_CALLBACK_EX: u32 = 0x7e;
/// Device (one per GPU or SLI group), child of the client.
pub const NV01_DEVICE_0: u32 = 0x80;
/// Subdevice (one GPU), child of a device.
pub const NV20_SUBDEVICE_0: u32 = 0x2080;
/// System (host) memory.
pub const NV01_MEMORY_SYSTEM: u32 = 0x3e;
/// Privileged local memory (the register BAR; takes no allocation params).
pub const NV01_MEMORY_LOCAL_PRIVILEGED: u32 = 0x3f;
/// Video memory (framebuffer) allocated for user space.
pub const NV01_MEMORY_LOCAL_USER: u32 = 0x40;
/// Virtual memory range (also named NV01_MEMORY_SYSTEM_DYNAMIC); params NV_MEMORY_VIRTUAL_ALLOCATION_PARAMS.
pub const NV01_MEMORY_VIRTUAL: u32 = 0x70;
/// System memory described by a user pointer; params NV_OS_DESC_MEMORY_ALLOCATION_PARAMS.
pub const NV01_MEMORY_SYSTEM_OS_DESCRIPTOR: u32 = 0x71;
/// Physical local memory.
pub const NV01_MEMORY_LOCAL_PHYSICAL: u32 = 0xc2;
/// Fabric memory.
pub const NV_MEMORY_FABRIC: u32 = 0xf8;
/// Multicast fabric memory.
pub const NV_MEMORY_MULTICAST_FABRIC: u32 = 0xfd;
/// Memory mapper.
pub const NV_MEMORY_MAPPER: u32 = 0xfe;
/// GPU virtual memory (an address range in a VA space).
pub const NV50_MEMORY_VIRTUAL: u32 = 0x50a0;
/// Third-party P2P.
pub const NV50_THIRD_PARTY_P2P: u32 = 0x503c;
/// Deviceless memory (system memory not tied to a GPU).
pub const NV01_MEMORY_DEVICELESS: u32 = 0x90ce;
/// GPU virtual address space.
pub const FERMI_VASPACE_A: u32 = 0x90f1;
/// Context share (TSG subcontext).
pub const FERMI_CONTEXT_SHARE_A: u32 = 0x9067;
/// Channel group (TSG).
pub const KEPLER_CHANNEL_GROUP_A: u32 = 0xa06c;
/// GPFIFO channel, Volta.
pub const VOLTA_CHANNEL_GPFIFO_A: u32 = 0xc36f;
/// GPFIFO channel, Turing.
pub const TURING_CHANNEL_GPFIFO_A: u32 = 0xc46f;
/// GPFIFO channel, Ampere.
pub const AMPERE_CHANNEL_GPFIFO_A: u32 = 0xc56f;
/// GPFIFO channel, Hopper.
pub const HOPPER_CHANNEL_GPFIFO_A: u32 = 0xc86f;
/// GPFIFO channel, Blackwell A.
pub const BLACKWELL_CHANNEL_GPFIFO_A: u32 = 0xc96f;
/// GPFIFO channel, Blackwell B.
pub const BLACKWELL_CHANNEL_GPFIFO_B: u32 = 0xca6f;
/// Compute engine object, Volta.
pub const VOLTA_COMPUTE_A: u32 = 0xc3c0;
/// Compute engine object, Turing.
pub const TURING_COMPUTE_A: u32 = 0xc5c0;
/// Compute engine object, Ampere A (GA100).
pub const AMPERE_COMPUTE_A: u32 = 0xc6c0;
/// Compute engine object, Ampere B (GA10x).
pub const AMPERE_COMPUTE_B: u32 = 0xc7c0;
/// Compute engine object, Ada.
pub const ADA_COMPUTE_A: u32 = 0xc9c0;
/// Compute engine object, Hopper.
pub const HOPPER_COMPUTE_A: u32 = 0xcbc0;
/// Compute engine object, Blackwell A.
pub const BLACKWELL_COMPUTE_A: u32 = 0xcdc0;
/// Compute engine object, Blackwell B.
pub const BLACKWELL_COMPUTE_B: u32 = 0xcec0;
/// Copy engine, Volta.
pub const VOLTA_DMA_COPY_A: u32 = 0xc3b5;
/// Copy engine, Turing.
pub const TURING_DMA_COPY_A: u32 = 0xc5b5;
/// Copy engine, Ampere A.
pub const AMPERE_DMA_COPY_A: u32 = 0xc6b5;
/// Copy engine, Ampere B.
pub const AMPERE_DMA_COPY_B: u32 = 0xc7b5;
/// Copy engine, Hopper.
pub const HOPPER_DMA_COPY_A: u32 = 0xc8b5;
/// Copy engine, Blackwell A.
pub const BLACKWELL_DMA_COPY_A: u32 = 0xc9b5;
/// Copy engine, Blackwell B.
pub const BLACKWELL_DMA_COPY_B: u32 = 0xcab5;
/// Usermode (doorbell) region, Volta.
pub const VOLTA_USERMODE_A: u32 = 0xc361;
/// Usermode (doorbell) region, Turing.
pub const TURING_USERMODE_A: u32 = 0xc461;
/// Usermode (doorbell) region, Ampere.
pub const AMPERE_USERMODE_A: u32 = 0xc561;
/// Usermode (doorbell) region, Hopper.
pub const HOPPER_USERMODE_A: u32 = 0xc661;
/// Usermode (doorbell) region, Blackwell.
pub const BLACKWELL_USERMODE_A: u32 = 0xc761;
/// UVM channel retainer.
pub const UVM_CHANNEL_RETAINER: u32 = 0xc574;
/// MMU fault buffer.
pub const MMU_FAULT_BUFFER: u32 = 0xc369;
/// Access-counter notify buffer.
pub const ACCESS_COUNTER_NOTIFY_BUFFER: u32 = 0xc365;
/// Debugger object (cuda-gdb, profilers).
pub const GT200_DEBUGGER: u32 = 0x83de;
/// Profiler device object.
pub const MAXWELL_PROFILER_DEVICE: u32 = 0xb2cc;
/// Profiler context object.
pub const MAXWELL_PROFILER_CONTEXT: u32 = 0xb1cc;
/// MPS compute object.
pub const MPS_COMPUTE: u32 = 0x900e;
/// RM user shared data (`cl00de.h`, 525+): a page RM updates for polling clients.
pub const RM_USER_SHARED_DATA: u32 = 0xde;
/// Binary API object (`cl2081.h`).
pub const NV2081_BINAPI: u32 = 0x2081;
/// Peer-to-peer mapping object (`cl503b.h`).
pub const NV50_P2P: u32 = 0x503b;
/// Subdevice master (`cl90e6.h`).
pub const GF100_SUBDEVICE_MASTER: u32 = 0x90e6;
/// Subdevice diagnostics (`cl208f.h`).
pub const NV20_SUBDEVICE_DIAG: u32 = 0x208f;
/// Confidential computing object (`clcb33.h`, 535+).
pub const NV_CONFIDENTIAL_COMPUTE: u32 = 0xcb33;
/// SEC2 work launch, Hopper (`clcba2.h`, 535+).
pub const HOPPER_SEC2_WORK_LAUNCH_A: u32 = 0xcba2;
/// MIG (SMC) configuration session (`clc639.h`, 515 .. 595): lets its client create and destroy GPU
/// instances. CUDA 13 allocates one under a second client at init (recording:
/// /work/shared/gpu/580.159.04/pytorch-1gib.jsonl, pid 444).
pub const AMPERE_SMC_CONFIG_SESSION: u32 = 0xc639;
/// MIG (SMC) monitoring session (`clc640.h`, 515 .. 595): lets its client see every GPU instance. Allocated
/// beside [`AMPERE_SMC_CONFIG_SESSION`] (same recording).
pub const AMPERE_SMC_MONITOR_SESSION: u32 = 0xc640;

/// Every class above, for iteration in user space and tests.
pub const ALL: [u32; 66] = [
    NV01_ROOT,
    NV01_ROOT_NON_PRIV,
    NV01_ROOT_CLIENT,
    NV01_EVENT,
    NV01_EVENT_KERNEL_CALLBACK,
    NV01_EVENT_OS_EVENT,
    NV01_EVENT_KERNEL_CALLBACK_EX,
    NV01_DEVICE_0,
    NV20_SUBDEVICE_0,
    NV01_MEMORY_SYSTEM,
    NV01_MEMORY_LOCAL_PRIVILEGED,
    NV01_MEMORY_LOCAL_USER,
    NV01_MEMORY_VIRTUAL,
    NV01_MEMORY_SYSTEM_OS_DESCRIPTOR,
    NV01_MEMORY_LOCAL_PHYSICAL,
    NV_MEMORY_FABRIC,
    NV_MEMORY_MULTICAST_FABRIC,
    NV_MEMORY_MAPPER,
    NV50_MEMORY_VIRTUAL,
    NV50_THIRD_PARTY_P2P,
    NV01_MEMORY_DEVICELESS,
    FERMI_VASPACE_A,
    FERMI_CONTEXT_SHARE_A,
    KEPLER_CHANNEL_GROUP_A,
    VOLTA_CHANNEL_GPFIFO_A,
    TURING_CHANNEL_GPFIFO_A,
    AMPERE_CHANNEL_GPFIFO_A,
    HOPPER_CHANNEL_GPFIFO_A,
    BLACKWELL_CHANNEL_GPFIFO_A,
    BLACKWELL_CHANNEL_GPFIFO_B,
    VOLTA_COMPUTE_A,
    TURING_COMPUTE_A,
    AMPERE_COMPUTE_A,
    AMPERE_COMPUTE_B,
    ADA_COMPUTE_A,
    HOPPER_COMPUTE_A,
    BLACKWELL_COMPUTE_A,
    BLACKWELL_COMPUTE_B,
    VOLTA_DMA_COPY_A,
    TURING_DMA_COPY_A,
    AMPERE_DMA_COPY_A,
    AMPERE_DMA_COPY_B,
    HOPPER_DMA_COPY_A,
    BLACKWELL_DMA_COPY_A,
    BLACKWELL_DMA_COPY_B,
    VOLTA_USERMODE_A,
    TURING_USERMODE_A,
    AMPERE_USERMODE_A,
    HOPPER_USERMODE_A,
    BLACKWELL_USERMODE_A,
    UVM_CHANNEL_RETAINER,
    MMU_FAULT_BUFFER,
    ACCESS_COUNTER_NOTIFY_BUFFER,
    GT200_DEBUGGER,
    MAXWELL_PROFILER_DEVICE,
    MAXWELL_PROFILER_CONTEXT,
    MPS_COMPUTE,
    RM_USER_SHARED_DATA,
    NV2081_BINAPI,
    NV50_P2P,
    GF100_SUBDEVICE_MASTER,
    NV20_SUBDEVICE_DIAG,
    NV_CONFIDENTIAL_COMPUTE,
    HOPPER_SEC2_WORK_LAUNCH_A,
    AMPERE_SMC_CONFIG_SESSION,
    AMPERE_SMC_MONITOR_SESSION,
];

/// The class's name (without value).
pub fn name(class: u32) -> Option<&'static str> {
    Some(match class {
        NV01_ROOT => "NV01_ROOT",
        NV01_ROOT_NON_PRIV => "NV01_ROOT_NON_PRIV",
        NV01_ROOT_CLIENT => "NV01_ROOT_CLIENT",
        NV01_EVENT => "NV01_EVENT",
        NV01_EVENT_KERNEL_CALLBACK => "NV01_EVENT_KERNEL_CALLBACK",
        NV01_EVENT_OS_EVENT => "NV01_EVENT_OS_EVENT",
        NV01_EVENT_KERNEL_CALLBACK_EX => "NV01_EVENT_KERNEL_CALLBACK_EX",
        NV01_DEVICE_0 => "NV01_DEVICE_0",
        NV20_SUBDEVICE_0 => "NV20_SUBDEVICE_0",
        NV01_MEMORY_SYSTEM => "NV01_MEMORY_SYSTEM",
        NV01_MEMORY_LOCAL_PRIVILEGED => "NV01_MEMORY_LOCAL_PRIVILEGED",
        NV01_MEMORY_LOCAL_USER => "NV01_MEMORY_LOCAL_USER",
        NV01_MEMORY_VIRTUAL => "NV01_MEMORY_VIRTUAL",
        NV01_MEMORY_SYSTEM_OS_DESCRIPTOR => "NV01_MEMORY_SYSTEM_OS_DESCRIPTOR",
        NV01_MEMORY_LOCAL_PHYSICAL => "NV01_MEMORY_LOCAL_PHYSICAL",
        NV_MEMORY_FABRIC => "NV_MEMORY_FABRIC",
        NV_MEMORY_MULTICAST_FABRIC => "NV_MEMORY_MULTICAST_FABRIC",
        NV_MEMORY_MAPPER => "NV_MEMORY_MAPPER",
        NV50_MEMORY_VIRTUAL => "NV50_MEMORY_VIRTUAL",
        NV50_THIRD_PARTY_P2P => "NV50_THIRD_PARTY_P2P",
        NV01_MEMORY_DEVICELESS => "NV01_MEMORY_DEVICELESS",
        FERMI_VASPACE_A => "FERMI_VASPACE_A",
        FERMI_CONTEXT_SHARE_A => "FERMI_CONTEXT_SHARE_A",
        KEPLER_CHANNEL_GROUP_A => "KEPLER_CHANNEL_GROUP_A",
        VOLTA_CHANNEL_GPFIFO_A => "VOLTA_CHANNEL_GPFIFO_A",
        TURING_CHANNEL_GPFIFO_A => "TURING_CHANNEL_GPFIFO_A",
        AMPERE_CHANNEL_GPFIFO_A => "AMPERE_CHANNEL_GPFIFO_A",
        HOPPER_CHANNEL_GPFIFO_A => "HOPPER_CHANNEL_GPFIFO_A",
        BLACKWELL_CHANNEL_GPFIFO_A => "BLACKWELL_CHANNEL_GPFIFO_A",
        BLACKWELL_CHANNEL_GPFIFO_B => "BLACKWELL_CHANNEL_GPFIFO_B",
        VOLTA_COMPUTE_A => "VOLTA_COMPUTE_A",
        TURING_COMPUTE_A => "TURING_COMPUTE_A",
        AMPERE_COMPUTE_A => "AMPERE_COMPUTE_A",
        AMPERE_COMPUTE_B => "AMPERE_COMPUTE_B",
        ADA_COMPUTE_A => "ADA_COMPUTE_A",
        HOPPER_COMPUTE_A => "HOPPER_COMPUTE_A",
        BLACKWELL_COMPUTE_A => "BLACKWELL_COMPUTE_A",
        BLACKWELL_COMPUTE_B => "BLACKWELL_COMPUTE_B",
        VOLTA_DMA_COPY_A => "VOLTA_DMA_COPY_A",
        TURING_DMA_COPY_A => "TURING_DMA_COPY_A",
        AMPERE_DMA_COPY_A => "AMPERE_DMA_COPY_A",
        AMPERE_DMA_COPY_B => "AMPERE_DMA_COPY_B",
        HOPPER_DMA_COPY_A => "HOPPER_DMA_COPY_A",
        BLACKWELL_DMA_COPY_A => "BLACKWELL_DMA_COPY_A",
        BLACKWELL_DMA_COPY_B => "BLACKWELL_DMA_COPY_B",
        VOLTA_USERMODE_A => "VOLTA_USERMODE_A",
        TURING_USERMODE_A => "TURING_USERMODE_A",
        AMPERE_USERMODE_A => "AMPERE_USERMODE_A",
        HOPPER_USERMODE_A => "HOPPER_USERMODE_A",
        BLACKWELL_USERMODE_A => "BLACKWELL_USERMODE_A",
        UVM_CHANNEL_RETAINER => "UVM_CHANNEL_RETAINER",
        MMU_FAULT_BUFFER => "MMU_FAULT_BUFFER",
        ACCESS_COUNTER_NOTIFY_BUFFER => "ACCESS_COUNTER_NOTIFY_BUFFER",
        GT200_DEBUGGER => "GT200_DEBUGGER",
        MAXWELL_PROFILER_DEVICE => "MAXWELL_PROFILER_DEVICE",
        MAXWELL_PROFILER_CONTEXT => "MAXWELL_PROFILER_CONTEXT",
        MPS_COMPUTE => "MPS_COMPUTE",
        RM_USER_SHARED_DATA => "RM_USER_SHARED_DATA",
        NV2081_BINAPI => "NV2081_BINAPI",
        NV50_P2P => "NV50_P2P",
        GF100_SUBDEVICE_MASTER => "GF100_SUBDEVICE_MASTER",
        NV20_SUBDEVICE_DIAG => "NV20_SUBDEVICE_DIAG",
        NV_CONFIDENTIAL_COMPUTE => "NV_CONFIDENTIAL_COMPUTE",
        HOPPER_SEC2_WORK_LAUNCH_A => "HOPPER_SEC2_WORK_LAUNCH_A",
        AMPERE_SMC_CONFIG_SESSION => "AMPERE_SMC_CONFIG_SESSION",
        AMPERE_SMC_MONITOR_SESSION => "AMPERE_SMC_MONITOR_SESSION",
        _ => return None,
    })
}

/// Root (client) classes: allocating one creates a client whose handle is `hObjectNew`.
#[inline(always)]
pub const fn is_root(class: u32) -> bool {
    matches!(class, NV01_ROOT | NV01_ROOT_NON_PRIV | NV01_ROOT_CLIENT)
}

/// Classes whose `pAllocParms` is an `NV_MEMORY_ALLOCATION_PARAMS` (128 bytes, size @64; see
/// [`crate::params::memory_alloc`]).
///
/// Decided from the RM sources (595): system memory 0x3e (`system_mem.c`), video memory 0x40
/// (`video_mem.c`), GPU virtual memory 0x50a0 (`virtual_mem.c`) and deviceless memory 0x90ce
/// (`no_device_mem.c`) read that struct. Not included: 0x3f (register memory, takes no params),
/// 0x70 (`NV_MEMORY_VIRTUAL_ALLOCATION_PARAMS`) and 0x71 (`NV_OS_DESC_MEMORY_ALLOCATION_PARAMS`).
#[inline(always)]
pub const fn is_memory(class: u32) -> bool {
    matches!(
        class,
        NV01_MEMORY_SYSTEM | NV01_MEMORY_LOCAL_USER | NV50_MEMORY_VIRTUAL | NV01_MEMORY_DEVICELESS
    )
}

/// Classes that allocate GPU video memory (framebuffer): what a GPU-memory ledger counts.
#[inline(always)]
pub const fn is_video_memory(class: u32) -> bool {
    class == NV01_MEMORY_LOCAL_USER
}

/// GPFIFO channel classes (Volta and later).
#[inline(always)]
pub const fn is_channel(class: u32) -> bool {
    matches!(
        class,
        VOLTA_CHANNEL_GPFIFO_A
            | TURING_CHANNEL_GPFIFO_A
            | AMPERE_CHANNEL_GPFIFO_A
            | HOPPER_CHANNEL_GPFIFO_A
            | BLACKWELL_CHANNEL_GPFIFO_A
            | BLACKWELL_CHANNEL_GPFIFO_B
    )
}

/// Compute engine classes (Volta and later).
#[inline(always)]
pub const fn is_compute(class: u32) -> bool {
    matches!(
        class,
        VOLTA_COMPUTE_A
            | TURING_COMPUTE_A
            | AMPERE_COMPUTE_A
            | AMPERE_COMPUTE_B
            | ADA_COMPUTE_A
            | HOPPER_COMPUTE_A
            | BLACKWELL_COMPUTE_A
            | BLACKWELL_COMPUTE_B
    )
}

/// Copy engine classes (Volta and later).
#[inline(always)]
pub const fn is_copy_engine(class: u32) -> bool {
    matches!(
        class,
        VOLTA_DMA_COPY_A
            | TURING_DMA_COPY_A
            | AMPERE_DMA_COPY_A
            | AMPERE_DMA_COPY_B
            | HOPPER_DMA_COPY_A
            | BLACKWELL_DMA_COPY_A
            | BLACKWELL_DMA_COPY_B
    )
}

/// Classes that are handles and hold nothing on the GPU: clients, the device and subdevice objects one
/// allocates to query a GPU, and the event and bookkeeping objects beside them. A client whose live objects
/// are all of these holds no GPU state: no memory, no address space, no channel, no context. NVML and
/// nvidia-smi make such clients, and so does CUDA's checkpoint right after it freed a process's state: it
/// reopens nvidiactl and nvidia0 and allocates a client, a device and a subdevice for a few queries
/// (recording: /work/shared/gpu/580.159.04/park-program.jsonl.gz, pid 440 thread 462 after its root
/// client's RM_FREE). So are the MIG session objects CUDA keeps in a second client beside a device and a
/// subdevice (AMPERE_SMC_CONFIG_SESSION, AMPERE_SMC_MONITOR_SESSION: rights to configure and to watch GPU
/// instances; same recording, client 0xc1d00022). Every other class, known or not, counts as GPU state.
#[inline(always)]
pub const fn is_handle_only(class: u32) -> bool {
    matches!(
        class,
        NV01_ROOT
            | NV01_ROOT_NON_PRIV
            | NV01_ROOT_CLIENT
            | NV01_DEVICE_0
            | NV20_SUBDEVICE_0
            | GF100_SUBDEVICE_MASTER
            | NV20_SUBDEVICE_DIAG
            | NV01_EVENT
            | NV01_EVENT_OS_EVENT
            | NV01_EVENT_KERNEL_CALLBACK
            | NV01_EVENT_KERNEL_CALLBACK_EX
            | NV2081_BINAPI
            | NV_CONFIDENTIAL_COMPUTE
            | AMPERE_SMC_CONFIG_SESSION
            | AMPERE_SMC_MONITOR_SESSION
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_class_is_named_and_distinct() {
        let mut seen = std::collections::HashSet::new();
        for c in ALL {
            assert!(name(c).is_some(), "class {c:#x} has no name");
            assert!(seen.insert(c), "class {c:#x} listed twice");
        }
        let named = (0..=0xffff).filter(|&c| name(c).is_some()).count();
        assert_eq!(named, ALL.len(), "a named class is missing from ALL");
    }

    /// Classes CUDA/NVML allocate (gVisor `pkg/abi/nvgpu/classes.go`), values from the 595.45.04
    /// `src/common/sdk/nvidia/inc/class/cl*.h` headers.
    #[test]
    fn classes_cuda_and_nvml_allocate() {
        for (c, n) in [
            (0xde, "RM_USER_SHARED_DATA"),
            (0x2081, "NV2081_BINAPI"),
            (0x503b, "NV50_P2P"),
            (0x90e6, "GF100_SUBDEVICE_MASTER"),
            (0x208f, "NV20_SUBDEVICE_DIAG"),
            (0xcb33, "NV_CONFIDENTIAL_COMPUTE"),
            (0xcba2, "HOPPER_SEC2_WORK_LAUNCH_A"),
        ] {
            assert_eq!(name(c), Some(n), "{c:#x}");
        }
    }

    /// The two classes the H200 recordings showed unnamed (/work/shared/gpu/580.159.04/README.md): values from
    /// `src/common/sdk/nvidia/inc/class/clc639.h` and `clc640.h` at 580.142 (the same at 515.43.04 and
    /// 595.45.04).
    #[test]
    fn classes_cuda_580_allocates() {
        for (c, n) in [
            (0xc639, "AMPERE_SMC_CONFIG_SESSION"),
            (0xc640, "AMPERE_SMC_MONITOR_SESSION"),
        ] {
            assert_eq!(name(c), Some(n), "{c:#x}");
        }
    }

    #[test]
    fn predicates() {
        assert!(is_root(0) && is_root(1) && is_root(0x41) && !is_root(0x80));
        assert!(is_memory(0x3e) && is_memory(0x40) && is_memory(0x50a0));
        assert!(!is_memory(0x3f) && !is_memory(0x70) && !is_memory(0x71));
        assert!(is_video_memory(0x40) && !is_video_memory(0x3e));
        assert!(is_channel(0xc86f) && !is_channel(0xcbc0));
        assert!(is_compute(0xcbc0) && !is_compute(0xc86f));
        assert!(is_copy_engine(0xc8b5));
        assert_eq!(name(NV01_DEVICE_0), Some("NV01_DEVICE_0"));
        assert!(is_handle_only(NV01_ROOT_CLIENT) && is_handle_only(NV20_SUBDEVICE_0));
        assert!(!is_handle_only(NV01_MEMORY_LOCAL_USER) && !is_handle_only(FERMI_VASPACE_A));
        assert!(!is_handle_only(HOPPER_CHANNEL_GPFIFO_A) && !is_handle_only(0xffff));
        assert!(
            is_handle_only(AMPERE_SMC_CONFIG_SESSION) && is_handle_only(AMPERE_SMC_MONITOR_SESSION)
        );
    }
}
