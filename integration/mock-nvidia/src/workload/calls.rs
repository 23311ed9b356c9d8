//! One function per NVIDIA call the workload makes: each builds the params struct for the driver band
//! (offsets from `baton-nvidia`), sends it, and returns what the driver wrote back (status, handle,
//! entries). RM calls return the RM status rather than failing on it, so tests can assert error statuses.

use baton_nvidia::layout::Layout;
use baton_nvidia::params::{
    card_info, check_version_str, memory_alloc, nvos00, nvos33, nvos34, nvos54, os_event,
    register_fd, rm_alloc,
};
use baton_nvidia::{escape, uvm};

use super::WorkloadError;
use super::nvfile::NvFile;
use crate::wire::{get_u32, get_u64, put_bytes, put_u32, put_u64};

/// The result of an allocation: the RM status and the handle the driver returned in `hObjectNew`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocated {
    /// RM status (`NV_OK` = 0).
    pub status: u32,
    /// `hObjectNew` after the call.
    pub handle: u32,
}

/// Which `RM_ALLOC` struct to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocForm {
    /// NVOS21 (what libcuda uses for most allocations).
    Nvos21,
    /// NVOS64 (with access rights; its size and status offset changed between bands).
    Nvos64,
}

/// `RM_ALLOC` of `class` with `hRoot`/`hObjectParent`/`hObjectNew`, and `alloc_params` (the class's
/// params struct, in this process's memory) behind `pAllocParms`.
pub fn rm_alloc(
    ctl: &NvFile,
    layout: &Layout,
    form: AllocForm,
    ids: [u32; 3],
    class: u32,
    alloc_params: Option<&mut [u8]>,
) -> Result<Allocated, WorkloadError> {
    let (size, status_offset, params_size_offset) = match form {
        AllocForm::Nvos21 => (
            layout.nvos21_size,
            layout.nvos21_status,
            layout.nvos21_params_size,
        ),
        AllocForm::Nvos64 => (
            layout.nvos64_size,
            layout.nvos64_status,
            layout.nvos64_params_size,
        ),
    };
    let mut params = vec![0u8; size as usize];
    put_u32(&mut params, rm_alloc::H_ROOT_OFFSET, ids[0]);
    put_u32(&mut params, rm_alloc::H_OBJECT_PARENT_OFFSET, ids[1]);
    put_u32(&mut params, rm_alloc::H_OBJECT_NEW_OFFSET, ids[2]);
    put_u32(&mut params, rm_alloc::H_CLASS_OFFSET, class);
    if let Some(alloc_params) = alloc_params {
        put_u64(
            &mut params,
            rm_alloc::P_ALLOC_PARMS_OFFSET,
            alloc_params.as_mut_ptr() as u64,
        );
        if let Some(offset) = params_size_offset {
            put_u32(&mut params, offset, alloc_params.len() as u32);
        }
    }
    ctl.escape(escape::RM_ALLOC, &mut params)?;
    Ok(Allocated {
        status: read_u32(&params, status_offset),
        handle: read_u32(&params, rm_alloc::H_OBJECT_NEW_OFFSET),
    })
}

/// An `NV_MEMORY_ALLOCATION_PARAMS` for the band, asking for `bytes`.
pub fn memory_alloc_params(layout: &Layout, bytes: u64) -> Vec<u8> {
    let mut params = vec![0u8; layout.memory_alloc_size as usize];
    put_u64(&mut params, memory_alloc::SIZE_OFFSET, bytes);
    params
}

/// `RM_FREE` of `object` (the client itself frees the whole client); returns the RM status.
pub fn rm_free(ctl: &NvFile, client: u32, parent: u32, object: u32) -> Result<u32, WorkloadError> {
    let mut params = vec![0u8; nvos00::SIZE as usize];
    put_u32(&mut params, nvos00::H_ROOT_OFFSET, client);
    put_u32(&mut params, nvos00::H_OBJECT_PARENT_OFFSET, parent);
    put_u32(&mut params, nvos00::H_OBJECT_OLD_OFFSET, object);
    ctl.escape(escape::RM_FREE, &mut params)?;
    Ok(read_u32(&params, nvos00::STATUS_OFFSET))
}

/// `RM_CONTROL` `cmd` on `object` with `control_params` behind the params pointer; returns the RM status.
pub fn rm_control(
    ctl: &NvFile,
    client: u32,
    object: u32,
    cmd: u32,
    control_params: &mut [u8],
) -> Result<u32, WorkloadError> {
    let mut params = vec![0u8; nvos54::SIZE as usize];
    put_u32(&mut params, nvos54::H_CLIENT_OFFSET, client);
    put_u32(&mut params, nvos54::H_OBJECT_OFFSET, object);
    put_u32(&mut params, nvos54::CMD_OFFSET, cmd);
    put_u64(
        &mut params,
        nvos54::PARAMS_OFFSET,
        control_params.as_mut_ptr() as u64,
    );
    put_u32(
        &mut params,
        nvos54::PARAMS_SIZE_OFFSET,
        control_params.len() as u32,
    );
    ctl.escape(escape::RM_CONTROL, &mut params)?;
    Ok(read_u32(&params, nvos54::STATUS_OFFSET))
}

/// What `RM_MAP_MEMORY` returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    /// RM status.
    pub status: u32,
    /// `pLinearAddress`: the offset to `mmap` the device file at.
    pub linear_address: u64,
}

/// `RM_MAP_MEMORY` of `length` bytes of `memory` (client, device, memory handles), to be mmapped through
/// the device file `device_fd`.
pub fn rm_map_memory(
    ctl: &NvFile,
    handles: [u32; 3],
    length: u64,
    device_fd: i32,
) -> Result<Mapped, WorkloadError> {
    let mut params = vec![0u8; nvos33::WITH_FD_SIZE as usize];
    put_u32(&mut params, nvos33::H_CLIENT_OFFSET, handles[0]);
    put_u32(&mut params, nvos33::H_DEVICE_OFFSET, handles[1]);
    put_u32(&mut params, nvos33::H_MEMORY_OFFSET, handles[2]);
    put_u64(&mut params, nvos33::LENGTH_OFFSET, length);
    put_u32(&mut params, nvos33::FD_OFFSET, device_fd as u32);
    ctl.escape(escape::RM_MAP_MEMORY, &mut params)?;
    Ok(Mapped {
        status: read_u32(&params, nvos33::STATUS_OFFSET),
        linear_address: get_u64(&params, nvos33::P_LINEAR_ADDRESS_OFFSET).unwrap_or(0),
    })
}

/// `RM_UNMAP_MEMORY` of the mapping at `linear_address`; returns the RM status.
pub fn rm_unmap_memory(
    ctl: &NvFile,
    handles: [u32; 3],
    linear_address: u64,
) -> Result<u32, WorkloadError> {
    let mut params = vec![0u8; nvos34::SIZE as usize];
    put_u32(&mut params, nvos34::H_CLIENT_OFFSET, handles[0]);
    put_u32(&mut params, nvos34::H_DEVICE_OFFSET, handles[1]);
    put_u32(&mut params, nvos34::H_MEMORY_OFFSET, handles[2]);
    put_u64(&mut params, nvos34::P_LINEAR_ADDRESS_OFFSET, linear_address);
    ctl.escape(escape::RM_UNMAP_MEMORY, &mut params)?;
    Ok(read_u32(&params, nvos34::STATUS_OFFSET))
}

/// `CARD_INFO` with CUDA's full array; returns the GPU ids of the valid entries.
pub fn card_info(ctl: &NvFile) -> Result<Vec<u32>, WorkloadError> {
    let entry = card_info::ENTRY_SIZE as usize;
    let mut params = vec![0u8; entry * card_info::MAX_ENTRIES as usize];
    ctl.escape(escape::CARD_INFO, &mut params)?;
    Ok(params
        .chunks(entry)
        .filter(|e| {
            e.get(card_info::VALID_OFFSET as usize)
                .copied()
                .unwrap_or(0)
                != 0
        })
        .map(|e| read_u32(e, card_info::GPU_ID_OFFSET))
        .collect())
}

/// `ATTACH_GPUS_TO_FD` with `gpu_ids`.
pub fn attach_gpus(ctl: &NvFile, gpu_ids: &[u32]) -> Result<(), WorkloadError> {
    let mut params: Vec<u8> = gpu_ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    ctl.escape(escape::ATTACH_GPUS_TO_FD, &mut params)
}

/// `REGISTER_FD` of `ctl_fd` on the device file `gpu`.
pub fn register_fd(gpu: &NvFile, ctl_fd: i32) -> Result<(), WorkloadError> {
    let mut params = vec![0u8; register_fd::SIZE as usize];
    put_u32(&mut params, register_fd::CTL_FD_OFFSET, ctl_fd as u32);
    gpu.escape(escape::REGISTER_FD, &mut params)
}

/// `ALLOC_OS_EVENT` (`escape::ALLOC_OS_EVENT`) or `FREE_OS_EVENT` (`nr`) on the device file `file` for
/// `client`'s `device`, naming `file`'s own fd as libcuda does; returns the status the driver wrote.
pub fn os_event(file: &NvFile, nr: u32, client: u32, device: u32) -> Result<u32, WorkloadError> {
    let mut params = vec![0u8; os_event::SIZE as usize];
    put_u32(&mut params, os_event::H_CLIENT_OFFSET, client);
    put_u32(&mut params, os_event::H_DEVICE_OFFSET, device);
    put_u32(&mut params, os_event::FD_OFFSET, file.raw_fd() as u32);
    file.escape(nr, &mut params)?;
    Ok(read_u32(&params, os_event::STATUS_OFFSET))
}

/// What `CHECK_VERSION_STR` answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionCheck {
    /// Whether the driver recognized our version.
    pub recognized: bool,
    /// The driver's own version string.
    pub driver_version: String,
}

/// `CHECK_VERSION_STR` in strict mode with our `version`, as libcuda sends it.
pub fn check_version(ctl: &NvFile, version: &str) -> Result<VersionCheck, WorkloadError> {
    let mut params = vec![0u8; check_version_str::SIZE as usize];
    put_u32(
        &mut params,
        check_version_str::CMD_OFFSET,
        check_version_str::CMD_STRICT,
    );
    let max = check_version_str::VERSION_STRING_LEN as usize - 1;
    let ours = &version.as_bytes()[..version.len().min(max)];
    put_bytes(&mut params, check_version_str::VERSION_STRING_OFFSET, ours);
    ctl.escape(escape::CHECK_VERSION_STR, &mut params)?;
    let start = check_version_str::VERSION_STRING_OFFSET as usize;
    let text = &params[start..start + check_version_str::VERSION_STRING_LEN as usize];
    let end = text.iter().position(|b| *b == 0).unwrap_or(text.len());
    Ok(VersionCheck {
        recognized: read_u32(&params, check_version_str::REPLY_OFFSET)
            == check_version_str::REPLY_RECOGNIZED,
        driver_version: String::from_utf8_lossy(&text[..end]).into_owned(),
    })
}

/// A UVM params buffer for `cmd` in the layout's driver band, `None` when the command does not exist there.
pub fn uvm_params(layout: &Layout, cmd: u32) -> Option<Vec<u8>> {
    layout
        .uvm_params(cmd)
        .map(|params| vec![0u8; params.size as usize])
}

/// Sends UVM `cmd` with `params` on `file`; returns the `rmStatus` the driver left in the params (the
/// mock cannot write it through FUSE, so it stays as sent: `NV_OK`).
pub fn uvm_call(
    file: &NvFile,
    layout: &Layout,
    cmd: u32,
    params: &mut [u8],
) -> Result<u32, WorkloadError> {
    let name = uvm::name(cmd).unwrap_or("UVM");
    file.uvm(cmd, name, params)?;
    Ok(layout
        .uvm_params(cmd)
        .and_then(|layout| layout.status_offset)
        .and_then(|offset| get_u32(params, offset))
        .unwrap_or(0))
}

fn read_u32(params: &[u8], offset: u32) -> u32 {
    // The buffers are sized from the same tables as the offsets, so the field is always there.
    get_u32(params, offset).unwrap_or(u32::MAX)
}
