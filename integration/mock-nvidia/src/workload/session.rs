//! The CUDA-like call sequence: setup (open the device files, allocate a client and its object tree,
//! register with UVM, map memory), training steps, orderly teardown, and the release / re-acquire cycle
//! that cuda-checkpoint performs (free everything and close every NVIDIA fd, then set it all up again).

use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::ptr::NonNull;

use baton_nvidia::layout::{DriverVersion, Layout};
use baton_nvidia::{class, ctrl, escape, status, uvm};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

use super::calls::{self, AllocForm};
use super::nvfile::NvFile;
use super::summary::{FailedCall, Summary};
use super::{WorkloadError, WorkloadOptions};

/// Bytes of the video memory the workload maps into its address space.
pub const MAP_BYTES: usize = 2 * 1024 * 1024;
/// Bytes of the scratch buffer passed as control params (the mock does not read them).
const CONTROL_PARAMS_BYTES: usize = 64;
/// First object handle the workload picks itself (mock-chosen, "CW"); the memory object's handle is
/// left to the driver.
const WORKLOAD_HANDLE_BASE: u32 = 0x4357_0000;

/// Handles of one setup's objects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Handles {
    /// The RM client.
    pub client: u32,
    /// `NV01_DEVICE_0`.
    pub device: u32,
    /// `NV20_SUBDEVICE_0`.
    pub subdevice: u32,
    /// `FERMI_VASPACE_A`.
    pub vaspace: u32,
    /// `NV01_MEMORY_LOCAL_USER` (handle chosen by the driver).
    pub memory: u32,
    /// `KEPLER_CHANNEL_GROUP_A`.
    pub channel_group: u32,
    /// `HOPPER_CHANNEL_GPFIFO_A`.
    pub channel: u32,
    /// `HOPPER_COMPUTE_A`.
    pub compute: u32,
}

#[derive(Debug)]
struct Mapping {
    address: NonNull<libc::c_void>,
    length: NonZeroUsize,
    linear_address: u64,
}

// SAFETY: a mapping of a device file belongs to the process, not to a thread: any thread may write to it
// or unmap it. `Mapping` is only reached through `&mut Workload` (the restore thread shares the workload
// behind a mutex), so the pointer is never used from two threads at once.
unsafe impl Send for Mapping {}

/// Everything one setup holds.
#[derive(Debug)]
struct Session {
    ctl: NvFile,
    gpu: NvFile,
    uvm: Option<NvFile>,
    uvm_mm: Option<NvFile>,
    handles: Handles,
    mapping: Option<Mapping>,
}

/// The mock CUDA workload.
#[derive(Debug)]
pub struct Workload {
    options: WorkloadOptions,
    layout: Layout,
    summary: Summary,
    session: Option<Session>,
}

impl Workload {
    /// A workload for `options` (nothing opened yet).
    pub fn new(options: WorkloadOptions) -> Result<Self, WorkloadError> {
        let version = DriverVersion::parse(&options.driver_version).ok_or_else(|| {
            WorkloadError::BadVersion {
                version: options.driver_version.clone(),
            }
        })?;
        let summary = Summary {
            pid: std::process::id(),
            driver_version: options.driver_version.clone(),
            ..Summary::default()
        };
        Ok(Self {
            layout: Layout::for_version(version),
            options,
            summary,
            session: None,
        })
    }

    /// What it did so far.
    pub fn summary(&self) -> &Summary {
        &self.summary
    }

    /// The handles of the current setup, if set up.
    pub fn handles(&self) -> Option<Handles> {
        self.session.as_ref().map(|session| session.handles)
    }

    /// Whether it holds GPU resources now.
    pub fn is_set_up(&self) -> bool {
        self.session.is_some()
    }

    /// Opens the device files and builds the whole object tree (a no-op when already set up).
    pub fn setup(&mut self) -> Result<(), WorkloadError> {
        if self.session.is_some() {
            return Ok(());
        }
        let ctl = self.open("nvidiactl")?;
        let client = self.alloc(
            &ctl,
            AllocForm::Nvos64,
            [0, 0, 0],
            class::NV01_ROOT_CLIENT,
            None,
        )?;
        let gpu_ids = calls::card_info(&ctl)?;
        self.count_escape(escape::CARD_INFO);
        if gpu_ids.is_empty() {
            return Err(WorkloadError::NoGpu {
                path: ctl.path().to_owned(),
            });
        }
        calls::attach_gpus(&ctl, &gpu_ids[..1])?;
        self.count_escape(escape::ATTACH_GPUS_TO_FD);
        let gpu = self.open("nvidia0")?;
        calls::register_fd(&gpu, ctl.raw_fd())?;
        self.count_escape(escape::REGISTER_FD);
        let check = calls::check_version(&ctl, &self.options.driver_version)?;
        self.count_escape(escape::CHECK_VERSION_STR);
        if !check.recognized {
            return Err(WorkloadError::VersionMismatch {
                ours: self.options.driver_version.clone(),
                driver: check.driver_version,
            });
        }
        // From here on a session exists, so a failure still tears down what was built.
        self.session = Some(Session {
            ctl,
            gpu,
            uvm: None,
            uvm_mm: None,
            handles: Handles {
                client,
                ..Handles::default()
            },
            mapping: None,
        });
        self.build_objects()?;
        self.register_uvm()?;
        self.map_memory()
    }

    /// One training step: the controls a CUDA launch loop makes, and a write into mapped memory.
    pub fn step(&mut self) -> Result<(), WorkloadError> {
        let handles = self.require_session()?.handles;
        self.control(
            handles.channel,
            ctrl::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN,
        )?;
        self.control(
            handles.subdevice,
            ctrl::NV2080_CTRL_CMD_TIMER_GET_GPU_CPU_TIME_CORRELATION_INFO,
        )?;
        if let Some(mapping) = self.session.as_ref().and_then(|s| s.mapping.as_ref()) {
            let step = self.summary.steps;
            // SAFETY: the mapping is live (it is only unmapped together with its removal from the
            // session) and MAP_BYTES long; writing one byte inside it is in bounds.
            unsafe {
                mapping
                    .address
                    .cast::<u8>()
                    .add((step as usize * 4096) % mapping.length.get())
                    .write_volatile(step as u8);
            }
        }
        self.summary.steps += 1;
        Ok(())
    }

    /// Frees everything and closes every NVIDIA fd, as cuda-checkpoint's release does.
    pub fn release(&mut self) -> Result<(), WorkloadError> {
        self.teardown_session(false)?;
        self.summary.releases += 1;
        Ok(())
    }

    /// Sets everything up again after [`Workload::release`].
    pub fn reacquire(&mut self) -> Result<(), WorkloadError> {
        self.setup()?;
        self.summary.reacquires += 1;
        Ok(())
    }

    /// Orderly teardown: unmap, free objects in reverse order, free the client, close the fds.
    pub fn teardown(&mut self) -> Result<(), WorkloadError> {
        self.teardown_session(true)
    }

    fn teardown_session(&mut self, object_by_object: bool) -> Result<(), WorkloadError> {
        let Some(session) = self.session.as_mut() else {
            return Ok(());
        };
        let handles = session.handles;
        let mapping = session.mapping.take();
        if let Some(mapping) = mapping {
            // SAFETY: `address`/`length` are exactly what mmap returned and nothing refers to the
            // mapping any more (it was just taken out of the session).
            unsafe { munmap(mapping.address, mapping.length.get()) }.map_err(|errno| {
                WorkloadError::Mmap {
                    path: self.device_path("nvidia0"),
                    source: errno.into(),
                }
            })?;
            let status = self.unmap(handles, mapping.linear_address)?;
            self.check("RM_UNMAP_MEMORY", status)?;
        }
        self.unregister_uvm()?;
        if object_by_object {
            for (parent, object) in [
                (handles.channel, handles.compute),
                (handles.channel_group, handles.channel),
                (handles.device, handles.channel_group),
                (handles.device, handles.memory),
                (handles.device, handles.vaspace),
                (handles.device, handles.subdevice),
                (handles.client, handles.device),
            ] {
                if object != 0 {
                    self.free(handles.client, parent, object)?;
                }
            }
        }
        if handles.client != 0 {
            // Freeing the client frees whatever is left of its tree.
            self.free(handles.client, handles.client, handles.client)?;
        }
        if let Some(session) = self.session.take() {
            let files = [
                Some(session.ctl),
                Some(session.gpu),
                session.uvm,
                session.uvm_mm,
            ];
            self.summary.fds_closed += files.iter().flatten().count() as u64;
            // Dropping the files closes the fds.
        }
        Ok(())
    }

    fn build_objects(&mut self) -> Result<(), WorkloadError> {
        let client = self.require_session()?.handles.client;
        let device = self.alloc_under(client, class::NV01_DEVICE_0, 1, None)?;
        self.set_handles(|h| h.device = device)?;
        let subdevice = self.alloc_under(device, class::NV20_SUBDEVICE_0, 2, None)?;
        self.set_handles(|h| h.subdevice = subdevice)?;
        let vaspace = self.alloc_under(device, class::FERMI_VASPACE_A, 3, None)?;
        self.set_handles(|h| h.vaspace = vaspace)?;
        let bytes = self.options.vram_mib.saturating_mul(1024 * 1024);
        let mut memory_params = calls::memory_alloc_params(&self.layout, bytes);
        // hObjectNew 0: the driver picks the memory handle.
        let memory = self.alloc_with_handle(
            [client, device, 0],
            class::NV01_MEMORY_LOCAL_USER,
            Some(&mut memory_params),
        )?;
        self.summary.vram_bytes_allocated += bytes;
        self.set_handles(|h| h.memory = memory)?;
        let channel_group = self.alloc_under(device, class::KEPLER_CHANNEL_GROUP_A, 4, None)?;
        self.set_handles(|h| h.channel_group = channel_group)?;
        let channel = self.alloc_under(channel_group, class::HOPPER_CHANNEL_GPFIFO_A, 5, None)?;
        self.set_handles(|h| h.channel = channel)?;
        let compute = self.alloc_under(channel, class::HOPPER_COMPUTE_A, 6, None)?;
        self.set_handles(|h| h.compute = compute)?;
        self.control(client, ctrl::NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS)?;
        self.control(device, ctrl::NV0080_CTRL_CMD_GPU_GET_CLASSLIST)?;
        self.control(subdevice, ctrl::NV2080_CTRL_CMD_GPU_GET_INFO_V2)?;
        self.control(vaspace, ctrl::NV90F1_CTRL_CMD_VASPACE_GET_GMMU_FORMAT)?;
        self.control(channel_group, ctrl::NVA06C_CTRL_CMD_GPFIFO_SCHEDULE)
    }

    fn register_uvm(&mut self) -> Result<(), WorkloadError> {
        let uvm_file = self.open("nvidia-uvm")?;
        let uvm_mm = self.open("nvidia-uvm")?;
        self.uvm(&uvm_file, uvm::INITIALIZE, |_| {})?;
        let uvm_fd = uvm_file.raw_fd();
        // UVM_MM_INITIALIZE exists from 535 on; it goes to the second fd and names the first.
        self.uvm(&uvm_mm, uvm::MM_INITIALIZE, |params| {
            crate::wire::put_u32(
                params,
                baton_nvidia::params::uvm::mm_initialize::UVM_FD_OFFSET,
                uvm_fd as u32,
            );
        })?;
        let session = self.require_session()?;
        let (ctl_fd, handles) = (session.ctl.raw_fd(), session.handles);
        self.uvm(&uvm_file, uvm::REGISTER_GPU, |params| {
            use baton_nvidia::params::uvm::register_gpu as p;
            crate::wire::put_u32(params, p::RM_CTRL_FD_OFFSET, ctl_fd as u32);
            crate::wire::put_u32(params, p::H_CLIENT_OFFSET, handles.client);
        })?;
        self.uvm(&uvm_file, uvm::REGISTER_GPU_VASPACE, |params| {
            use baton_nvidia::params::uvm::register_gpu_vaspace as p;
            crate::wire::put_u32(params, p::RM_CTRL_FD_OFFSET, ctl_fd as u32);
            crate::wire::put_u32(params, p::H_CLIENT_OFFSET, handles.client);
            crate::wire::put_u32(params, p::H_VA_SPACE_OFFSET, handles.vaspace);
        })?;
        let session = self.require_session_mut()?;
        session.uvm = Some(uvm_file);
        session.uvm_mm = Some(uvm_mm);
        Ok(())
    }

    fn unregister_uvm(&mut self) -> Result<(), WorkloadError> {
        let Some(uvm_file) = self.session.as_mut().and_then(|s| s.uvm.take()) else {
            return Ok(());
        };
        self.uvm(&uvm_file, uvm::UNREGISTER_GPU_VASPACE, |_| {})?;
        self.uvm(&uvm_file, uvm::UNREGISTER_GPU, |_| {})?;
        if let Some(session) = self.session.as_mut() {
            session.uvm = Some(uvm_file);
        }
        Ok(())
    }

    fn map_memory(&mut self) -> Result<(), WorkloadError> {
        let session = self.require_session()?;
        let handles = session.handles;
        let gpu_fd = session.gpu.raw_fd();
        let mapped = calls::rm_map_memory(
            &session.ctl,
            [handles.client, handles.device, handles.memory],
            MAP_BYTES as u64,
            gpu_fd,
        )?;
        self.count_escape(escape::RM_MAP_MEMORY);
        self.check("RM_MAP_MEMORY", mapped.status)?;
        let length = NonZeroUsize::new(MAP_BYTES).ok_or(WorkloadError::NoGpu {
            path: self.device_path("nvidia0"),
        })?;
        let offset = libc::off_t::try_from(mapped.linear_address).unwrap_or(libc::off_t::MAX);
        let session = self.require_session()?;
        // SAFETY: a fresh shared mapping of the device file at an address the kernel picks; it
        // aliases no Rust object, and it is unmapped before the file is closed (teardown_session).
        let address = unsafe {
            mmap(
                None,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                session.gpu.as_fd(),
                offset,
            )
        }
        .map_err(|errno| WorkloadError::Mmap {
            path: session.gpu.path().to_owned(),
            source: errno.into(),
        })?;
        // SAFETY: the mapping is MAP_BYTES long and writable; the first byte is in bounds.
        unsafe { address.cast::<u8>().write_volatile(0x5a) };
        self.summary.mmaps += 1;
        self.require_session_mut()?.mapping = Some(Mapping {
            address,
            length,
            linear_address: mapped.linear_address,
        });
        Ok(())
    }
}

/// Small helpers around the calls: counting, status checks, handle bookkeeping.
impl Workload {
    fn device_path(&self, name: &str) -> std::path::PathBuf {
        self.options.dev_dir.join(name)
    }

    fn open(&mut self, name: &str) -> Result<NvFile, WorkloadError> {
        let file = NvFile::open(&self.device_path(name))?;
        *self.summary.fds_opened.entry(name.to_owned()).or_default() += 1;
        Ok(file)
    }

    fn require_session(&self) -> Result<&Session, WorkloadError> {
        self.session.as_ref().ok_or(WorkloadError::NotSetUp)
    }

    fn require_session_mut(&mut self) -> Result<&mut Session, WorkloadError> {
        self.session.as_mut().ok_or(WorkloadError::NotSetUp)
    }

    fn set_handles(&mut self, set: impl FnOnce(&mut Handles)) -> Result<(), WorkloadError> {
        set(&mut self.require_session_mut()?.handles);
        Ok(())
    }

    fn count_escape(&mut self, nr: u32) {
        let name = escape::name(nr).unwrap_or("unknown").to_owned();
        *self.summary.escapes.entry(name).or_default() += 1;
    }

    /// Records a non-`NV_OK` status and turns it into an error.
    fn check(&mut self, call: &str, code: u32) -> Result<(), WorkloadError> {
        if code == status::NV_OK {
            return Ok(());
        }
        self.summary.failed_statuses.push(FailedCall {
            call: call.to_owned(),
            status: code,
            status_name: status::name(code).map(str::to_owned),
        });
        Err(WorkloadError::Status {
            call: call.to_owned(),
            status: code,
        })
    }

    fn alloc_under(
        &mut self,
        parent: u32,
        class_id: u32,
        index: u32,
        params: Option<&mut [u8]>,
    ) -> Result<u32, WorkloadError> {
        let client = self.require_session()?.handles.client;
        self.alloc_with_handle(
            [client, parent, WORKLOAD_HANDLE_BASE + index],
            class_id,
            params,
        )
    }

    fn alloc_with_handle(
        &mut self,
        ids: [u32; 3],
        class_id: u32,
        params: Option<&mut [u8]>,
    ) -> Result<u32, WorkloadError> {
        let session = self.session.take().ok_or(WorkloadError::NotSetUp)?;
        let result = self.alloc(&session.ctl, AllocForm::Nvos21, ids, class_id, params);
        self.session = Some(session);
        result
    }

    fn alloc(
        &mut self,
        ctl: &NvFile,
        form: AllocForm,
        ids: [u32; 3],
        class_id: u32,
        params: Option<&mut [u8]>,
    ) -> Result<u32, WorkloadError> {
        let allocated = calls::rm_alloc(ctl, &self.layout, form, ids, class_id, params)?;
        self.count_escape(escape::RM_ALLOC);
        let name = class::name(class_id).unwrap_or("unknown class");
        self.check(&format!("RM_ALLOC {name}"), allocated.status)?;
        *self.summary.allocs_by_class.entry(class_id).or_default() += 1;
        Ok(allocated.handle)
    }

    fn free(&mut self, client: u32, parent: u32, object: u32) -> Result<(), WorkloadError> {
        let code = calls::rm_free(&self.require_session()?.ctl, client, parent, object)?;
        self.count_escape(escape::RM_FREE);
        self.check("RM_FREE", code)?;
        self.summary.frees += 1;
        Ok(())
    }

    fn unmap(&mut self, handles: Handles, linear_address: u64) -> Result<u32, WorkloadError> {
        let session = self.require_session()?;
        let code = calls::rm_unmap_memory(
            &session.ctl,
            [handles.client, handles.device, handles.memory],
            linear_address,
        )?;
        self.count_escape(escape::RM_UNMAP_MEMORY);
        Ok(code)
    }

    fn control(&mut self, object: u32, cmd: u32) -> Result<(), WorkloadError> {
        let session = self.require_session()?;
        let mut params = [0u8; CONTROL_PARAMS_BYTES];
        let code = calls::rm_control(
            &session.ctl,
            session.handles.client,
            object,
            cmd,
            &mut params,
        )?;
        self.count_escape(escape::RM_CONTROL);
        self.summary.controls += 1;
        let name = ctrl::name(cmd).unwrap_or("unknown control");
        self.check(&format!("RM_CONTROL {name}"), code)
    }

    /// Sends UVM `cmd` on `file` with params filled by `fill`, if the command exists in this band.
    fn uvm(
        &mut self,
        file: &NvFile,
        cmd: u32,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), WorkloadError> {
        let Some(mut params) = calls::uvm_params(&self.layout, cmd) else {
            return Ok(());
        };
        fill(&mut params);
        let code = calls::uvm_call(file, &self.layout, cmd, &mut params)?;
        let name = uvm::name(cmd).unwrap_or("UVM");
        *self
            .summary
            .uvm_commands
            .entry(name.to_owned())
            .or_default() += 1;
        self.check(name, code)
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        if let Some(session) = self.session.as_mut()
            && let Some(mapping) = session.mapping.take()
        {
            // SAFETY: exactly the region mmap returned; nothing refers to it any more.
            let _ = unsafe { munmap(mapping.address, mapping.length.get()) };
        }
    }
}
