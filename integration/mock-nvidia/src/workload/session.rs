//! The CUDA-like call sequence: setup (open the device files, allocate a client and its object tree,
//! register with UVM, map video and system memory, open an OS-event fd pair), training steps, and the
//! orderly teardown a program makes itself (unmap, free, close). The park and resume that cuda-checkpoint
//! performs are in [`super::park`]; the calls' bookkeeping in [`super::ops`].
//!
//! What a setup holds, as libcuda holds it on a real driver (recorded on an H200 with driver 580.159.04:
//! /work/shared/gpu/580.159.04/maps-running.txt and park-program.jsonl.gz): nvidiactl, nvidia0 (with
//! `REGISTER_FD`), two nvidia-uvm fds, an OS-event nvidia0 fd and its dup; and mappings made through a fresh
//! fd each (open, `RM_MAP_MEMORY` naming it, mmap, close), so that only the mapping keeps its file open.

use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::ptr::NonNull;

use baton_nvidia::layout::{DriverVersion, Layout};
use baton_nvidia::{class, ctrl, escape, uvm};
use nix::sys::mman::{MapFlags, MmapAdvise, ProtFlags, madvise, mmap, munmap};

use super::calls::{self, AllocForm};
use super::nvfile::NvFile;
use super::park::Parked;
use super::summary::Summary;
use super::{WorkloadError, WorkloadOptions};

/// Bytes of the video memory the workload maps into its address space.
pub const MAP_BYTES: usize = 2 * 1024 * 1024;
/// Bytes of the system memory object the workload allocates and maps (through nvidiactl).
pub const SYSTEM_MAP_BYTES: usize = 64 * 1024;
/// First object handle the workload picks itself (mock-chosen, "CW"); the memory object's handle is
/// left to the driver.
pub(super) const WORKLOAD_HANDLE_BASE: u32 = 0x4357_0000;

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
    /// `NV01_MEMORY_SYSTEM`.
    pub system_memory: u32,
    /// `KEPLER_CHANNEL_GROUP_A`.
    pub channel_group: u32,
    /// `HOPPER_CHANNEL_GPFIFO_A`.
    pub channel: u32,
    /// `HOPPER_COMPUTE_A`.
    pub compute: u32,
}

/// Which memory a mapping shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Video memory (`NV01_MEMORY_LOCAL_USER`), mapped through nvidia0.
    Video,
    /// System memory (`NV01_MEMORY_SYSTEM`), mapped through nvidiactl and marked `MADV_DONTFORK`: a child
    /// forked after CUDA init inherits every device mapping but one (30 of 31 on the H200:
    /// /work/shared/gpu/580.159.04/README.md, "Forked children").
    System,
}

impl MemoryKind {
    /// Both kinds, in mapping order.
    pub const ALL: [Self; 2] = [Self::Video, Self::System];

    /// The device file the mapping is made through.
    pub fn node(self) -> &'static str {
        match self {
            Self::Video => "nvidia0",
            Self::System => "nvidiactl",
        }
    }

    /// Bytes mapped.
    pub fn length(self) -> usize {
        match self {
            Self::Video => MAP_BYTES,
            Self::System => SYSTEM_MAP_BYTES,
        }
    }

    /// The memory object the mapping shows.
    pub fn handle(self, handles: &Handles) -> u32 {
        match self {
            Self::Video => handles.memory,
            Self::System => handles.system_memory,
        }
    }
}

/// A live mapping of device or system memory.
#[derive(Debug)]
pub(super) struct Mapping {
    pub(super) kind: MemoryKind,
    pub(super) address: NonNull<libc::c_void>,
    pub(super) length: NonZeroUsize,
    pub(super) linear_address: u64,
}

// SAFETY: a mapping of a device file belongs to the process, not to a thread: any thread may write to it
// or unmap it. `Mapping` is only reached through `&mut Workload` (the restore thread shares the workload
// behind a mutex), so the pointer is never used from two threads at once.
unsafe impl Send for Mapping {}

/// The OS-event fd pair: an nvidia0 fd with `ALLOC_OS_EVENT` on it, and its dup (the number the
/// application polls, which a park keeps reserved).
#[derive(Debug)]
pub(super) struct OsEvent {
    pub(super) file: NvFile,
    pub(super) dup: NvFile,
}

/// Everything one setup holds.
#[derive(Debug)]
pub(super) struct Session {
    pub(super) ctl: NvFile,
    pub(super) gpu: NvFile,
    pub(super) uvm: Option<NvFile>,
    pub(super) uvm_mm: Option<NvFile>,
    pub(super) event: Option<OsEvent>,
    pub(super) handles: Handles,
    pub(super) mappings: Vec<Mapping>,
}

/// The mock CUDA workload.
#[derive(Debug)]
pub struct Workload {
    pub(super) options: WorkloadOptions,
    pub(super) layout: Layout,
    pub(super) summary: Summary,
    pub(super) session: Option<Session>,
    /// What a park left to resume from (reserved fd numbers and address ranges).
    pub(super) parked: Option<Parked>,
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
            parked: None,
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
        self.set_up(None)
    }

    /// The setup, fresh (`parked` is `None`) or resuming a park: then the uvm fds and the OS-event dup go
    /// back to their old numbers and the mappings to their old addresses.
    pub(super) fn set_up(&mut self, mut parked: Option<&mut Parked>) -> Result<(), WorkloadError> {
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
        self.register_fd(&gpu, &ctl)?;
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
            event: None,
            handles: Handles {
                client,
                ..Handles::default()
            },
            mappings: Vec::new(),
        });
        self.build_objects()?;
        self.register_uvm(parked.as_deref_mut())?;
        for kind in MemoryKind::ALL {
            let address = parked.as_ref().and_then(|p| p.reserved_address(kind));
            self.map_memory(kind, address)?;
        }
        self.open_os_event(parked.as_mut().and_then(|p| p.event.take()))
    }

    /// One training step: the controls a CUDA launch loop makes, and a write into mapped video memory.
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
        let video = self
            .session
            .as_ref()
            .and_then(|s| s.mappings.iter().find(|m| m.kind == MemoryKind::Video));
        if let Some(mapping) = video {
            let step = self.summary.steps;
            // SAFETY: the mapping is live (it is only unmapped or replaced together with its removal from
            // the session) and `length` long; writing one byte inside it is in bounds.
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

    /// Frees everything and closes every NVIDIA fd in order, as a program that gives the GPU up itself
    /// does (SIGUSR1): unmaps, frees and closes. cuda-checkpoint parks differently ([`Workload::park`]).
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
        let mappings = std::mem::take(&mut session.mappings);
        let event = session.event.take();
        for mapping in mappings {
            // SAFETY: `address`/`length` are exactly what mmap returned and nothing refers to the
            // mapping any more (it was just taken out of the session).
            unsafe { munmap(mapping.address, mapping.length.get()) }.map_err(|errno| {
                WorkloadError::Mmap {
                    path: self.device_path(mapping.kind.node()),
                    source: errno.into(),
                }
            })?;
            let status = self.unmap(
                handles,
                mapping.kind.handle(&handles),
                mapping.linear_address,
            )?;
            self.check("RM_UNMAP_MEMORY", status)?;
        }
        if let Some(event) = event {
            self.close(event.dup);
            self.free_os_event(event.file, handles)?;
        }
        self.unregister_uvm()?;
        if object_by_object {
            for (parent, object) in [
                (handles.channel, handles.compute),
                (handles.channel_group, handles.channel),
                (handles.device, handles.channel_group),
                (handles.device, handles.system_memory),
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
            for file in [
                Some(session.ctl),
                Some(session.gpu),
                session.uvm,
                session.uvm_mm,
            ]
            .into_iter()
            .flatten()
            {
                self.close(file);
            }
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
        let mut system_params = calls::memory_alloc_params(&self.layout, SYSTEM_MAP_BYTES as u64);
        let system_memory = self.alloc_under(
            device,
            class::NV01_MEMORY_SYSTEM,
            7,
            Some(&mut system_params),
        )?;
        self.set_handles(|h| h.system_memory = system_memory)?;
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

    /// Opens the two uvm fds (onto their old numbers when resuming a park), initializes UVM and registers
    /// the GPU and the VA space.
    fn register_uvm(&mut self, mut parked: Option<&mut Parked>) -> Result<(), WorkloadError> {
        let uvm_file = self.open_onto("nvidia-uvm", parked.as_mut().and_then(|p| p.uvm.take()))?;
        let uvm_mm = self.open_onto("nvidia-uvm", parked.and_then(|p| p.uvm_mm.take()))?;
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

    pub(super) fn unregister_uvm(&mut self) -> Result<(), WorkloadError> {
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

    /// Maps `kind`'s memory as libcuda does: a fresh fd of its device file, `RM_MAP_MEMORY` naming it, mmap,
    /// close (the mapping alone keeps the file open). With `at`, the mapping goes to that address, over a
    /// park's PROT_NONE reservation (`MAP_FIXED`), as the H200's resume did
    /// (/work/shared/gpu/580.159.04/maps-resumed.txt: every device range back at its address).
    fn map_memory(
        &mut self,
        kind: MemoryKind,
        at: Option<NonZeroUsize>,
    ) -> Result<(), WorkloadError> {
        let handles = self.require_session()?.handles;
        let file = self.open(kind.node())?;
        let mapped = calls::rm_map_memory(
            &self.require_session()?.ctl,
            [handles.client, handles.device, kind.handle(&handles)],
            kind.length() as u64,
            file.raw_fd(),
        )?;
        self.count_escape(escape::RM_MAP_MEMORY);
        self.check("RM_MAP_MEMORY", mapped.status)?;
        let length = NonZeroUsize::new(kind.length()).ok_or(WorkloadError::NotSetUp)?;
        let offset = libc::off_t::try_from(mapped.linear_address).unwrap_or(libc::off_t::MAX);
        let flags = match at {
            Some(_) => MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
            None => MapFlags::MAP_SHARED,
        };
        // SAFETY: a shared mapping of the device file, either where the kernel picks (aliasing no Rust
        // object) or at `at`, which is this workload's own PROT_NONE reservation of exactly this length,
        // left by its park (nothing else lives there). It is unmapped or replaced before it is dropped.
        let address = unsafe {
            mmap(
                at,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                flags,
                file.as_fd(),
                offset,
            )
        }
        .map_err(|errno| WorkloadError::Mmap {
            path: file.path().to_owned(),
            source: errno.into(),
        })?;
        self.summary.mmaps += 1;
        if kind == MemoryKind::System {
            // SAFETY: `address`/`length` are the mapping just made; MADV_DONTFORK changes no content.
            unsafe { madvise(address, length.get(), MmapAdvise::MADV_DONTFORK) }.map_err(
                |errno| WorkloadError::Mmap {
                    path: file.path().to_owned(),
                    source: errno.into(),
                },
            )?;
        }
        self.close(file);
        // SAFETY: the mapping is `length` long and writable; the first byte is in bounds.
        unsafe { address.cast::<u8>().write_volatile(0x5a) };
        self.require_session_mut()?.mappings.push(Mapping {
            kind,
            address,
            length,
            linear_address: mapped.linear_address,
        });
        Ok(())
    }

    /// Opens the OS-event pair: an nvidia0 fd with `REGISTER_FD` and `ALLOC_OS_EVENT`, and its dup, which
    /// goes onto `placeholder`'s number when resuming (the H200's resume: open, `ALLOC_OS_EVENT`, dup onto
    /// the old number, the new fd kept: /work/shared/gpu/580.159.04/park-program.jsonl.gz, pid 440 tid 462).
    fn open_os_event(
        &mut self,
        placeholder: Option<std::os::fd::OwnedFd>,
    ) -> Result<(), WorkloadError> {
        let file = self.open("nvidia0")?;
        let handles = self.require_session()?.handles;
        let ctl_fd = self.require_session()?.ctl.raw_fd();
        calls::register_fd(&file, ctl_fd)?;
        self.count_escape(escape::REGISTER_FD);
        let code = calls::os_event(
            &file,
            escape::ALLOC_OS_EVENT,
            handles.client,
            handles.device,
        )?;
        self.count_escape(escape::ALLOC_OS_EVENT);
        self.check("ALLOC_OS_EVENT", code)?;
        let dup = match placeholder {
            Some(placeholder) => super::park::dup_onto(&file, placeholder)?,
            None => file.duplicate()?,
        };
        self.require_session_mut()?.event = Some(OsEvent { file, dup });
        Ok(())
    }

    /// `FREE_OS_EVENT` on the event's own fd, then closes it.
    pub(super) fn free_os_event(
        &mut self,
        file: NvFile,
        handles: Handles,
    ) -> Result<(), WorkloadError> {
        let code = calls::os_event(&file, escape::FREE_OS_EVENT, handles.client, handles.device)?;
        self.count_escape(escape::FREE_OS_EVENT);
        self.close(file);
        self.check("FREE_OS_EVENT", code)
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        if let Some(session) = self.session.as_mut() {
            for mapping in session.mappings.drain(..) {
                // SAFETY: exactly the region mmap returned; nothing refers to it any more.
                let _ = unsafe { munmap(mapping.address, mapping.length.get()) };
            }
        }
    }
}
