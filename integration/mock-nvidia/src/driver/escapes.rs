//! Decoding NVIDIA frontend ioctls (as FUSE hands them over: exactly `_IOC_SIZE(cmd)` bytes) into RM
//! requests, and writing results back where the real driver writes them: the status field at the band's
//! offset, returned handles, `CARD_INFO` entries, the version string. UVM commands carry no data through
//! FUSE and are only counted.

use baton_nvidia::layout::{DriverVersion, Layout};
use baton_nvidia::params::{
    card_info, check_version_str, memory_alloc, nvos00, nvos02, nvos32, nvos33, nvos34, nvos54,
    os_event, register_fd, rm_alloc, status_code, xfer,
};
use baton_nvidia::{class, ctrl, escape, ioc, status};
use fuser::Errno;

use super::nodes::Node;
use super::rm::{AllocRequest, Rm};
use super::state::MappingState;
use super::user_memory;
use crate::wire::{get_u32, get_u64, put_bytes, put_u8, put_u16, put_u32, put_u64};

/// Most GPUs the mock serves (the entries of one `CARD_INFO` array).
pub const MAX_GPUS: u32 = card_info::MAX_ENTRIES;

/// The band layout for a version string like `595.45.04`.
pub fn layout_for(driver_version: &str) -> Result<Layout, String> {
    let version = DriverVersion::parse(driver_version).ok_or_else(|| {
        format!("driver version {driver_version:?} is not like 595.45.04 (major.minor[.patch])")
    })?;
    Ok(Layout::for_version(version))
}

/// The ioctl decoder for one mock configuration.
#[derive(Debug, Clone)]
pub struct Escapes {
    layout: Layout,
}

/// The fake GPU id of GPU `index` (`CARD_INFO` and `ATTACH_GPUS_TO_FD`): PCI bus `index + 1` in the
/// kernel's `bus << 8` form (mock-chosen).
pub fn gpu_id(index: u32) -> u32 {
    (index + 1) << 8
}

impl Escapes {
    /// A decoder using `layout` for the band-dependent structs.
    pub fn new(layout: Layout) -> Self {
        Self { layout }
    }

    /// Handles `cmd` with params `input` on file `fh` opened as `node`, for the calling `pid`.
    /// Returns the bytes to copy back, or the errno the ioctl fails with.
    pub fn handle(
        &self,
        rm: &mut Rm,
        fh: u64,
        pid: u32,
        cmd: u32,
        input: &[u8],
    ) -> Result<Vec<u8>, Errno> {
        let node = rm.node_of(fh).ok_or(Errno::EBADF)?;
        rm.count_ioctl(fh);
        if matches!(node, Node::Uvm | Node::UvmTools) {
            // UVM commands are bare numbers: FUSE copies nothing, so only the command is seen.
            rm.uvm_command(fh, cmd);
            return Ok(Vec::new());
        }
        if self.layout.accepts_escape(ioc::nr(cmd), ioc::size(cmd)) == Some(false) {
            // 595.44.02+ (`nv_validate_ioctls`): an unknown number or a wrong size fails before RM.
            return Err(Errno::EINVAL);
        }
        let size = ioc::size(cmd) as usize;
        if input.len() < size {
            // Only _IOW/_IOWR commands bring their params through FUSE; NVIDIA userspace sends _IOWR.
            return Err(Errno::EINVAL);
        }
        let mut params = input[..size].to_vec();
        let nr = ioc::nr(cmd);
        if nr == escape::IOCTL_XFER_CMD {
            self.xfer(rm, fh, node, pid, &params)?;
            return Ok(params);
        }
        self.escape(rm, fh, node, pid, nr, &mut params)?;
        Ok(params)
    }

    /// One escape on `params` (already copied in).
    fn escape(
        &self,
        rm: &mut Rm,
        fh: u64,
        node: Node,
        pid: u32,
        nr: u32,
        params: &mut [u8],
    ) -> Result<(), Errno> {
        match nr {
            escape::RM_ALLOC => self.rm_alloc(rm, fh, pid, params),
            escape::RM_FREE => {
                let field = |offset| get_u32(params, offset).ok_or(Errno::EINVAL);
                let code = rm.free(
                    fh,
                    field(nvos00::H_ROOT_OFFSET)?,
                    field(nvos00::H_OBJECT_OLD_OFFSET)?,
                );
                write_status(rm, params, nvos00::STATUS_OFFSET, code)
            }
            escape::RM_CONTROL => rm_control(rm, fh, params),
            escape::RM_ALLOC_MEMORY => rm_alloc_memory(rm, fh, params),
            escape::RM_VID_HEAP_CONTROL => vid_heap_control(rm, fh, params),
            escape::RM_MAP_MEMORY => rm_map_memory(rm, fh, params),
            escape::RM_UNMAP_MEMORY => {
                let field = |offset| get_u32(params, offset).ok_or(Errno::EINVAL);
                let code = rm.unmap_memory(
                    fh,
                    field(nvos34::H_CLIENT_OFFSET)?,
                    field(nvos34::H_DEVICE_OFFSET)?,
                    field(nvos34::H_MEMORY_OFFSET)?,
                );
                write_status(rm, params, nvos34::STATUS_OFFSET, code)
            }
            escape::CARD_INFO => card_info_entries(rm, params),
            escape::REGISTER_FD if matches!(node, Node::Gpu(_)) => {
                let ctl_fd = get_u32(params, register_fd::CTL_FD_OFFSET).ok_or(Errno::EINVAL)?;
                rm.register_fd(fh, ctl_fd as i32);
                Ok(())
            }
            escape::CHECK_VERSION_STR => check_version(rm, params),
            escape::ATTACH_GPUS_TO_FD => attach_gpus(rm, fh, params),
            escape::ALLOC_OS_EVENT | escape::FREE_OS_EVENT => {
                write_status(rm, params, os_event::STATUS_OFFSET, status::NV_OK)
            }
            escape::STATUS_CODE => {
                write_status(rm, params, status_code::STATUS_OFFSET, status::NV_OK)
            }
            // Known escapes the mock does not model: accepted, params left as they came.
            known if escape::name(known).is_some() && known != escape::REGISTER_FD => Ok(()),
            _ => Err(Errno::EINVAL),
        }
    }

    /// `RM_ALLOC` with NVOS21 or NVOS64, told apart by size as the driver does.
    fn rm_alloc(&self, rm: &mut Rm, fh: u64, pid: u32, params: &mut [u8]) -> Result<(), Errno> {
        // NVOS21 or NVOS64 by size; a struct of another band has a size the driver refuses.
        let layout = self
            .layout
            .rm_alloc_layout(params.len() as u32)
            .ok_or(Errno::EINVAL)?;
        let status_offset = layout.status;
        let field = |offset| get_u32(params, offset).ok_or(Errno::EINVAL);
        let class_id = field(rm_alloc::H_CLASS_OFFSET)?;
        let alloc_params = get_u64(params, rm_alloc::P_ALLOC_PARMS_OFFSET).unwrap_or(0);
        let request = AllocRequest {
            root: field(rm_alloc::H_ROOT_OFFSET)?,
            parent: field(rm_alloc::H_OBJECT_PARENT_OFFSET)?,
            new: field(rm_alloc::H_OBJECT_NEW_OFFSET)?,
            class: class_id,
            bytes: memory_size(class_id, pid, alloc_params),
            device_id: device_id(class_id, pid, alloc_params),
        };
        match rm.alloc(fh, request) {
            Ok(handle) => {
                put_u32(params, rm_alloc::H_OBJECT_NEW_OFFSET, handle);
                write_status(rm, params, status_offset, status::NV_OK)
            }
            Err(code) => write_status(rm, params, status_offset, code),
        }
    }

    /// `IOCTL_XFER_CMD`: the real params live at `ptr` in the caller's memory. The mock reads them
    /// like the driver's `copy_from_user`, runs the inner escape and copies the result back.
    fn xfer(&self, rm: &mut Rm, fh: u64, node: Node, pid: u32, params: &[u8]) -> Result<(), Errno> {
        let inner_nr = get_u32(params, xfer::CMD_OFFSET).ok_or(Errno::EINVAL)?;
        let inner_size = get_u32(params, xfer::SIZE_OFFSET).ok_or(Errno::EINVAL)?;
        let pointer = get_u64(params, xfer::PTR_OFFSET).ok_or(Errno::EINVAL)?;
        if inner_size == 0 || inner_size > xfer::MAX_PARAMS || inner_nr == escape::IOCTL_XFER_CMD {
            return Err(Errno::EINVAL);
        }
        let mut inner =
            user_memory::read(pid, pointer, inner_size as usize).map_err(|_| Errno::EFAULT)?;
        self.escape(rm, fh, node, pid, inner_nr, &mut inner)?;
        user_memory::write(pid, pointer, &inner).map_err(|_| Errno::EFAULT)
    }
}

/// Offset of `deviceId` (u32) in `NV0080_ALLOC_PARAMETERS`, the `pAllocParms` of `NV01_DEVICE_0`
/// (src/common/sdk/nvidia/inc/class/cl0080.h).
const NV0080_DEVICE_ID_OFFSET: u64 = 0;

/// The device instance an `NV01_DEVICE_0` allocation asks for, read from its `NV0080_ALLOC_PARAMETERS` in
/// the caller's memory; `None` for other classes, no params (the driver then uses instance 0), or params
/// the mock cannot read (it then uses instance 0 too, where the driver would fail the copy-in).
fn device_id(class_id: u32, pid: u32, alloc_params: u64) -> Option<u32> {
    if class_id != class::NV01_DEVICE_0 || alloc_params == 0 {
        return None;
    }
    let address = alloc_params.checked_add(NV0080_DEVICE_ID_OFFSET)?;
    let bytes = user_memory::read(pid, address, 4).ok()?;
    get_u32(&bytes, 0)
}

/// Bytes requested by a memory-class allocation, read from its `NV_MEMORY_ALLOCATION_PARAMS` in the
/// caller's memory; `None` for other classes or when the caller's memory cannot be read.
fn memory_size(class_id: u32, pid: u32, alloc_params: u64) -> Option<u64> {
    if !class::is_memory(class_id) || alloc_params == 0 {
        return None;
    }
    let address = alloc_params.checked_add(u64::from(memory_alloc::SIZE_OFFSET))?;
    let bytes = user_memory::read(pid, address, 8).ok()?;
    get_u64(&bytes, 0)
}

fn write_status(rm: &mut Rm, params: &mut [u8], offset: u32, code: u32) -> Result<(), Errno> {
    let code = rm.answered(code);
    if put_u32(params, offset, code) {
        Ok(())
    } else {
        Err(Errno::EINVAL)
    }
}

fn rm_control(rm: &mut Rm, fh: u64, params: &mut [u8]) -> Result<(), Errno> {
    let field = |offset| get_u32(params, offset).ok_or(Errno::EINVAL);
    let (client, object, cmd) = (
        field(nvos54::H_CLIENT_OFFSET)?,
        field(nvos54::H_OBJECT_OFFSET)?,
        field(nvos54::CMD_OFFSET)?,
    );
    rm.count_control();
    let mut code = rm.check_object(fh, client, object);
    if code == status::NV_OK {
        let target = rm.class_of(fh, client, object);
        if ctrl::name(cmd).is_none() || !control_fits(cmd, target) {
            code = status::NV_ERR_NOT_SUPPORTED;
        }
    }
    write_status(rm, params, nvos54::STATUS_OFFSET, code)
}

/// Whether a known control command is exported by an object of class `target` (`None`: the client).
fn control_fits(cmd: u32, target: Option<u32>) -> bool {
    let cmd_class = ctrl::class_of(cmd);
    match target {
        None => class::is_root(cmd_class),
        Some(object) if class::is_channel(cmd_class) => class::is_channel(object),
        Some(object) if class::name(cmd_class).is_some() => object == cmd_class,
        // Control classes the mock has no class entry for: accepted on any object.
        Some(_) => true,
    }
}

fn rm_alloc_memory(rm: &mut Rm, fh: u64, params: &mut [u8]) -> Result<(), Errno> {
    let field = |offset| get_u32(params, offset).ok_or(Errno::EINVAL);
    let limit = get_u64(params, nvos02::LIMIT_OFFSET).ok_or(Errno::EINVAL)?;
    let request = AllocRequest {
        root: field(nvos02::H_ROOT_OFFSET)?,
        parent: field(nvos02::H_OBJECT_PARENT_OFFSET)?,
        new: field(nvos02::H_OBJECT_NEW_OFFSET)?,
        class: field(nvos02::H_CLASS_OFFSET)?,
        bytes: Some(limit.saturating_add(1)),
        device_id: None,
    };
    let code = match rm.alloc(fh, request) {
        Ok(handle) => {
            put_u32(params, nvos02::H_OBJECT_NEW_OFFSET, handle);
            status::NV_OK
        }
        Err(code) => code,
    };
    write_status(rm, params, nvos02::STATUS_OFFSET, code)
}

fn vid_heap_control(rm: &mut Rm, fh: u64, params: &mut [u8]) -> Result<(), Errno> {
    let field = |offset| get_u32(params, offset).ok_or(Errno::EINVAL);
    let (client, parent, memory) = (
        field(nvos32::H_ROOT_OFFSET)?,
        field(nvos32::H_OBJECT_PARENT_OFFSET)?,
        field(nvos32::H_MEMORY_OFFSET)?,
    );
    let code = match field(nvos32::FUNCTION_OFFSET)? {
        nvos32::FUNCTION_ALLOC_SIZE => {
            let request = AllocRequest {
                root: client,
                parent,
                new: memory,
                class: class::NV01_MEMORY_LOCAL_USER,
                bytes: get_u64(params, nvos32::ALLOC_SIZE_OFFSET),
                device_id: None,
            };
            match rm.alloc(fh, request) {
                Ok(handle) => {
                    put_u32(params, nvos32::H_MEMORY_OFFSET, handle);
                    status::NV_OK
                }
                Err(code) => code,
            }
        }
        nvos32::FUNCTION_FREE => rm.free(fh, client, memory),
        _ => status::NV_ERR_NOT_SUPPORTED,
    };
    // The heap of the parent's GPU (GPU 0 when the parent is unknown).
    let (total, used) = rm.vram_of_gpu(rm.gpu_of(fh, client, parent).unwrap_or(0));
    put_u64(params, nvos32::TOTAL_OFFSET, total);
    put_u64(params, nvos32::FREE_OFFSET, total.saturating_sub(used));
    write_status(rm, params, nvos32::STATUS_OFFSET, code)
}

fn rm_map_memory(rm: &mut Rm, fh: u64, params: &mut [u8]) -> Result<(), Errno> {
    let field = |offset| get_u32(params, offset).ok_or(Errno::EINVAL);
    let offset = get_u64(params, nvos33::OFFSET_OFFSET).ok_or(Errno::EINVAL)?;
    let mapping = MappingState {
        client: field(nvos33::H_CLIENT_OFFSET)?,
        device: field(nvos33::H_DEVICE_OFFSET)?,
        memory: field(nvos33::H_MEMORY_OFFSET)?,
        length: get_u64(params, nvos33::LENGTH_OFFSET).ok_or(Errno::EINVAL)?,
    };
    let code = rm.map_memory(fh, mapping);
    if code == status::NV_OK {
        // The address to mmap the device file at: the mock maps memory at its offset.
        put_u64(params, nvos33::P_LINEAR_ADDRESS_OFFSET, offset);
    }
    write_status(rm, params, nvos33::STATUS_OFFSET, code)
}

fn card_info_entries(rm: &Rm, params: &mut [u8]) -> Result<(), Errno> {
    let entry_size = card_info::ENTRY_SIZE as usize;
    if params.is_empty() || !params.len().is_multiple_of(entry_size) {
        return Err(Errno::EINVAL);
    }
    params.fill(0);
    let config = rm.config();
    let entries = (params.len() / entry_size).min(config.gpus as usize);
    for (index, entry) in params.chunks_mut(entry_size).take(entries).enumerate() {
        let index = index as u32;
        put_u8(entry, card_info::VALID_OFFSET, 1);
        put_u8(entry, card_info::PCI_BUS_OFFSET, (index + 1) as u8);
        put_u16(
            entry,
            card_info::PCI_VENDOR_ID_OFFSET,
            card_info::PCI_VENDOR_NVIDIA,
        );
        put_u32(entry, card_info::GPU_ID_OFFSET, gpu_id(index));
        // Not the driver's value: the H200 answered fb_size 0x4000000000 (256 GiB, its framebuffer BAR,
        // not its 143,771 MiB of memory; /work/shared/gpu/580.159.04/pytorch-1gib.jsonl, NV_ESC_CARD_INFO).
        // The mock writes each GPU's capacity there instead.
        put_u64(entry, card_info::FB_SIZE_OFFSET, config.vram_bytes_per_gpu);
        put_u32(entry, card_info::MINOR_NUMBER_OFFSET, index);
        let name = format!("nvidia{index}");
        let name = &name.as_bytes()[..name.len().min(card_info::DEV_NAME_LEN as usize - 1)];
        put_bytes(entry, card_info::DEV_NAME_OFFSET, name);
    }
    Ok(())
}

fn check_version(rm: &Rm, params: &mut [u8]) -> Result<(), Errno> {
    let cmd = get_u32(params, check_version_str::CMD_OFFSET).ok_or(Errno::EINVAL)?;
    let ours = rm.config().driver_version.clone();
    let start = check_version_str::VERSION_STRING_OFFSET as usize;
    let len = check_version_str::VERSION_STRING_LEN as usize;
    let theirs_raw = params.get(start..start + len).ok_or(Errno::EINVAL)?;
    let theirs_len = theirs_raw.iter().position(|b| *b == 0).unwrap_or(len);
    let theirs = String::from_utf8_lossy(&theirs_raw[..theirs_len]).into_owned();
    let recognized = match cmd {
        check_version_str::CMD_QUERY | check_version_str::CMD_RELAXED => true,
        _ => theirs == ours,
    };
    let reply = if recognized {
        check_version_str::REPLY_RECOGNIZED
    } else {
        check_version_str::REPLY_UNRECOGNIZED
    };
    put_u32(params, check_version_str::REPLY_OFFSET, reply);
    // The driver answers with its own version string (what a mismatch message shows).
    let mut version = vec![0u8; len];
    let copy = ours.len().min(len - 1);
    version[..copy].copy_from_slice(&ours.as_bytes()[..copy]);
    put_bytes(params, check_version_str::VERSION_STRING_OFFSET, &version);
    Ok(())
}

fn attach_gpus(rm: &mut Rm, fh: u64, params: &[u8]) -> Result<(), Errno> {
    if !params.len().is_multiple_of(4) {
        return Err(Errno::EINVAL);
    }
    let gpus = rm.config().gpus;
    let ids: Vec<u32> = params
        .chunks_exact(4)
        .filter_map(|chunk| chunk.try_into().ok().map(u32::from_le_bytes))
        .collect();
    if ids
        .iter()
        .any(|id| !(0..gpus).any(|index| gpu_id(index) == *id))
    {
        // Like the driver: attaching a GPU id it does not have fails the ioctl.
        return Err(Errno::EINVAL);
    }
    rm.attach_gpus(fh, ids);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::rm::RmConfig;

    fn rm(version: &str) -> Rm {
        Rm::new(RmConfig {
            driver_version: version.to_owned(),
            gpus: 1,
            vram_bytes_per_gpu: 1 << 30,
        })
    }

    /// An RM_FREE of client 0xc1d00001 padded to `size` bytes, status field set to a marker.
    fn free_params(size: usize) -> Vec<u8> {
        let mut params = vec![0u8; size];
        put_u32(&mut params, nvos00::H_ROOT_OFFSET, 0xc1d0_0001);
        put_u32(&mut params, nvos00::H_OBJECT_OLD_OFFSET, 0xc1d0_0001);
        put_u32(&mut params, nvos00::STATUS_OFFSET, 0xdead);
        params
    }

    /// From 595.44.02 the driver (`nv_validate_ioctls`, kernel-open/nvidia/nv.c) fails an escape whose
    /// `_IOC_SIZE` is not its struct's, or an unknown number, with EINVAL before RM runs it; 590.48.01
    /// lets it through to RM, which answers in the status field.
    #[test]
    fn wrong_size_is_einval_from_595_44_02() {
        for version in ["595.44.02", "595.45.04"] {
            let escapes = Escapes::new(layout_for(version).unwrap());
            let mut rm = rm(version);
            let fh = rm.open(Node::Ctl, 1);
            let wrong = ioc::iowr(ioc::NV_IOCTL_MAGIC, escape::RM_FREE, 20);
            let answer = escapes.handle(&mut rm, fh, 1, wrong, &free_params(20));
            assert_eq!(answer.err(), Some(Errno::EINVAL), "{version}");
            let unknown = ioc::iowr(ioc::NV_IOCTL_MAGIC, 0x99, 16);
            let answer = escapes.handle(&mut rm, fh, 1, unknown, &free_params(16));
            assert_eq!(answer.err(), Some(Errno::EINVAL), "{version}");
            let right = ioc::iowr(ioc::NV_IOCTL_MAGIC, escape::RM_FREE, 16);
            let out = escapes.handle(&mut rm, fh, 1, right, &free_params(16));
            let status = out.ok().and_then(|p| get_u32(&p, nvos00::STATUS_OFFSET));
            assert!(
                status.is_some_and(|s| s != 0xdead),
                "{version}: RM answered"
            );
        }
        let version = "590.48.01";
        let escapes = Escapes::new(layout_for(version).unwrap());
        let mut rm = rm(version);
        let fh = rm.open(Node::Ctl, 1);
        let wrong = ioc::iowr(ioc::NV_IOCTL_MAGIC, escape::RM_FREE, 20);
        let out = escapes.handle(&mut rm, fh, 1, wrong, &free_params(20));
        let status = out.ok().and_then(|p| get_u32(&p, nvos00::STATUS_OFFSET));
        assert!(
            status.is_some_and(|s| s != 0xdead),
            "{version}: RM answered"
        );
    }

    /// `RM_VID_HEAP_CONTROL` alloc of `bytes` under device 1 of `client`; returns (status, total, free).
    fn vid_heap_alloc(
        escapes: &Escapes,
        rm: &mut Rm,
        fh: u64,
        client: u32,
        bytes: u64,
    ) -> [u64; 3] {
        let mut params = vec![0u8; nvos32::SIZE as usize];
        put_u32(&mut params, nvos32::H_ROOT_OFFSET, client);
        put_u32(&mut params, nvos32::H_OBJECT_PARENT_OFFSET, 1);
        put_u32(
            &mut params,
            nvos32::FUNCTION_OFFSET,
            nvos32::FUNCTION_ALLOC_SIZE,
        );
        put_u64(&mut params, nvos32::ALLOC_SIZE_OFFSET, bytes);
        put_u32(&mut params, nvos32::STATUS_OFFSET, 0xdead);
        let cmd = ioc::iowr(
            ioc::NV_IOCTL_MAGIC,
            escape::RM_VID_HEAP_CONTROL,
            nvos32::SIZE,
        );
        let out = escapes.handle(rm, fh, 1, cmd, &params).unwrap();
        [
            u64::from(get_u32(&out, nvos32::STATUS_OFFSET).unwrap()),
            get_u64(&out, nvos32::TOTAL_OFFSET).unwrap(),
            get_u64(&out, nvos32::FREE_OFFSET).unwrap(),
        ]
    }

    /// A video-memory allocation past its GPU's free memory comes back with the status in the params, and
    /// the heap's total and free are its GPU's.
    #[test]
    fn vid_heap_alloc_past_capacity_is_refused_in_the_status_field() {
        let escapes = Escapes::new(layout_for("595.45.04").unwrap());
        let mut rm = rm("595.45.04");
        let fh = rm.open(Node::Ctl, 1);
        let root = AllocRequest {
            root: 0,
            parent: 0,
            new: 0,
            class: class::NV01_ROOT_CLIENT,
            bytes: None,
            device_id: None,
        };
        let client = rm.alloc(fh, root).unwrap();
        let device = AllocRequest {
            root: client,
            parent: client,
            new: 1,
            class: class::NV01_DEVICE_0,
            ..root
        };
        assert_eq!(rm.alloc(fh, device), Ok(1));
        let gib = 1u64 << 30;
        let ok = u64::from(status::NV_OK);
        let refused = u64::from(status::NV_ERR_INSUFFICIENT_RESOURCES);
        assert_eq!(
            vid_heap_alloc(&escapes, &mut rm, fh, client, gib / 2),
            [ok, gib, gib / 2]
        );
        assert_eq!(
            vid_heap_alloc(&escapes, &mut rm, fh, client, gib / 2 + 1),
            [refused, gib, gib / 2]
        );
        assert_eq!(
            vid_heap_alloc(&escapes, &mut rm, fh, client, gib / 2),
            [ok, gib, 0]
        );
        assert_eq!(rm.vram(), (gib, gib));
    }
}
