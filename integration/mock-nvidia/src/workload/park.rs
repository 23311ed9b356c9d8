//! The park and the resume that `cuda-checkpoint` (or the driver API's `cuCheckpointProcess*`) performs, in
//! a thread of the parked process itself, as the H200 recorded them with driver 580.159.04
//! (/work/shared/gpu/580.159.04/park-program.jsonl.gz, pid 440 thread 462, and maps-running.txt,
//! maps-parked.txt, maps-resumed.txt).
//!
//! Park: the OS-event fds go first (`FREE_OS_EVENT`, close); after the copy of device memory to the host
//! (the restore thread's), each device mapping is replaced in place by an anonymous PROT_NONE reservation
//! (`mmap(MAP_FIXED)`, never `munmap`) and its memory object freed, one by one; then the channels; UVM is
//! left (`UVM_UNREGISTER_GPU_VASPACE`, `UVM_UNREGISTER_GPU`) and its fds closed; the remaining top-level
//! objects are freed and then the root client explicitly (`RM_FREE` with `hObjectOld == hRoot`); nvidiactl
//! and nvidia0 are closed; and the driver is queried once more through nvidiactl and nvidia0 opened for a
//! moment. The numbers of the uvm fds and of the OS-event dup stay taken by eventfds while parked (the
//! parked process's fd list in maps-parked.txt).
//!
//! Resume: the same queries, then the files are opened again, the uvm fds and the OS-event dup go back to
//! their old numbers (open, `dup3` onto the number, close of the temporary), the objects are allocated
//! again and every mapping goes back to its old address, `MAP_FIXED` over its reservation.

use std::num::NonZeroUsize;
use std::os::fd::{AsFd, OwnedFd};

use baton_nvidia::{class, ctrl};
use nix::fcntl::OFlag;
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::mman::{MapFlags, ProtFlags, mmap_anonymous};
use nix::unistd::{dup3, dup3_raw};

use super::WorkloadError;
use super::calls::AllocForm;
use super::nvfile::NvFile;
use super::session::{Mapping, MemoryKind, Workload};

/// First object handle of the driver queries that end a park (mock-chosen, "CQ").
const QUERY_HANDLE_BASE: u32 = 0x4351_0000;
/// `RM_CONTROL` calls the driver queries of a park (or of a resume) make.
pub const QUERY_CONTROLS: u64 = 3;

/// What a park leaves for the resume: the fd numbers kept by eventfd placeholders, and the address ranges
/// kept by PROT_NONE reservations.
#[derive(Debug, Default)]
pub struct Parked {
    /// The placeholder at the first uvm fd's number.
    pub(super) uvm: Option<OwnedFd>,
    /// The placeholder at the second uvm fd's number (`UVM_MM_INITIALIZE`'s).
    pub(super) uvm_mm: Option<OwnedFd>,
    /// The placeholder at the OS-event dup's number.
    pub(super) event: Option<OwnedFd>,
    /// Each device mapping's reservation: which memory it showed, its address and length.
    pub(super) reservations: Vec<(MemoryKind, NonZeroUsize, NonZeroUsize)>,
}

impl Parked {
    /// Where `kind`'s mapping was, if the park reserved it.
    pub(super) fn reserved_address(&self, kind: MemoryKind) -> Option<NonZeroUsize> {
        self.reservations
            .iter()
            .find(|(k, _, _)| *k == kind)
            .map(|(_, address, _)| *address)
    }
}

/// Puts `file` onto `placeholder`'s fd number (`dup3`, close-on-exec, which closes the placeholder's
/// eventfd); returns the file at that number. `file`'s own fd is left for the caller to keep or close.
pub(super) fn dup_onto(file: &NvFile, mut placeholder: OwnedFd) -> Result<NvFile, WorkloadError> {
    dup3(file.as_fd(), &mut placeholder, OFlag::O_CLOEXEC).map_err(|errno| WorkloadError::Fd {
        what: format!("dup3 of {} onto its old fd number", file.path().display()),
        source: errno.into(),
    })?;
    Ok(NvFile::from_fd(placeholder, file.path()))
}

impl Workload {
    /// Whether a park left state to resume from.
    pub fn is_parked(&self) -> bool {
        self.parked.is_some()
    }

    /// The first step of a park, before the copy: `FREE_OS_EVENT` and close of the OS-event fds, the dup's
    /// number kept by an eventfd (the H200's checkpoint thread started with these: close of the dup,
    /// `FREE_OS_EVENT`, close; park-program.jsonl.gz, pid 440 tid 462). A no-op when already done.
    pub fn park_os_events(&mut self) -> Result<(), WorkloadError> {
        let session = self.require_session_mut()?;
        let handles = session.handles;
        let Some(event) = session.event.take() else {
            return Ok(());
        };
        let placeholder = self.close_and_reserve(event.dup)?;
        self.parked.get_or_insert_default().event = Some(placeholder);
        self.free_os_event(event.file, handles)
    }

    /// The rest of the park, after the copy: see the module documentation. Leaves no NVIDIA fd, no device
    /// mapping and no RM object of this process; then queries the driver through files it closes again.
    pub fn park(&mut self) -> Result<(), WorkloadError> {
        self.park_os_events()?;
        let session = self.require_session_mut()?;
        let handles = session.handles;
        let mappings = std::mem::take(&mut session.mappings);
        for mapping in mappings {
            self.reserve(mapping)?;
        }
        // Memory objects one by one (no RM_UNMAP_MEMORY: the recording has none for the program's memory).
        for kind in MemoryKind::ALL {
            let memory = kind.handle(&handles);
            if memory != 0 {
                self.free(handles.client, handles.device, memory)?;
            }
        }
        // The channels.
        for (parent, object) in [
            (handles.channel, handles.compute),
            (handles.channel_group, handles.channel),
            (handles.device, handles.channel_group),
        ] {
            if object != 0 {
                self.free(handles.client, parent, object)?;
            }
        }
        self.unregister_uvm()?;
        let session = self.require_session_mut()?;
        let (uvm, uvm_mm) = (session.uvm.take(), session.uvm_mm.take());
        if let Some(uvm) = uvm {
            let placeholder = self.close_and_reserve(uvm)?;
            self.parked.get_or_insert_default().uvm = Some(placeholder);
        }
        if let Some(uvm_mm) = uvm_mm {
            let placeholder = self.close_and_reserve(uvm_mm)?;
            self.parked.get_or_insert_default().uvm_mm = Some(placeholder);
        }
        // The remaining top-level objects, then the root client itself.
        for (parent, object) in [
            (handles.device, handles.vaspace),
            (handles.device, handles.subdevice),
            (handles.client, handles.device),
            (handles.client, handles.client),
        ] {
            if object != 0 {
                self.free(handles.client, parent, object)?;
            }
        }
        if let Some(session) = self.session.take() {
            self.close(session.gpu);
            self.close(session.ctl);
        }
        self.summary.releases += 1;
        self.query_driver()
    }

    /// Resumes a park: the driver queries, then the whole setup again with the uvm fds and the OS-event
    /// dup on their old numbers and every mapping at its old address.
    ///
    /// A resume the GPU has no room for (its memory allocation refused) leaves the process parked, as
    /// cuda-checkpoint leaves a process CHECKPOINTED when its restore runs out of GPU memory
    /// (/work/shared/reference/nvidia-driver.md, cuda-checkpoint's known failure modes; no recording covers
    /// it): what the attempt built is let go, the placeholders and reservations stay, and a later resume can
    /// succeed ([`WorkloadError::is_out_of_memory`]).
    pub fn resume(&mut self) -> Result<(), WorkloadError> {
        let mut parked = self.parked.take().ok_or(WorkloadError::NotParked)?;
        let result = self
            .query_driver()
            .and_then(|()| self.set_up(Some(&mut parked)));
        match result {
            Ok(()) => {
                self.summary.reacquires += 1;
                Ok(())
            }
            Err(error) if error.is_out_of_memory() => {
                // The allocation is refused before the uvm fds and mappings are taken back: `parked` is whole.
                if let Some(session) = self.session.take() {
                    self.close(session.gpu);
                    self.close(session.ctl);
                }
                self.parked = Some(parked);
                Err(error)
            }
            Err(error) => Err(error),
        }
    }

    /// Replaces `mapping` in place by an anonymous PROT_NONE reservation (`mmap(MAP_FIXED)`, no munmap):
    /// maps-running.txt's /dev/nvidia* ranges are `---p` anonymous ranges at the same addresses in
    /// maps-parked.txt (/work/shared/gpu/580.159.04/).
    fn reserve(&mut self, mapping: Mapping) -> Result<(), WorkloadError> {
        let address =
            NonZeroUsize::new(mapping.address.as_ptr() as usize).ok_or(WorkloadError::NotSetUp)?;
        // SAFETY: the range is exactly this workload's own device mapping (as mmap returned it), just taken
        // out of the session, so nothing refers to it any more; the anonymous PROT_NONE mapping put over it
        // is this workload's too, and nothing reads or writes it.
        let reserved = unsafe {
            mmap_anonymous(
                Some(address),
                mapping.length,
                ProtFlags::PROT_NONE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED | MapFlags::MAP_NORESERVE,
            )
        }
        .map_err(|errno| WorkloadError::Mmap {
            path: self.device_path(mapping.kind.node()),
            source: errno.into(),
        })?;
        debug_assert_eq!(reserved, mapping.address, "MAP_FIXED maps at the address");
        self.parked.get_or_insert_default().reservations.push((
            mapping.kind,
            address,
            mapping.length,
        ));
        Ok(())
    }

    /// Closes `file` and takes its number back at once with an eventfd, returned as the placeholder: the
    /// parked H200 process held eventfds at the numbers of its uvm and OS-event fds (maps-parked.txt).
    fn close_and_reserve(&mut self, file: NvFile) -> Result<OwnedFd, WorkloadError> {
        let number = file.raw_fd();
        let fd_error = |what: &str, errno: nix::errno::Errno| WorkloadError::Fd {
            what: format!("{what} for fd {number} ({})", file.path().display()),
            source: errno.into(),
        };
        let eventfd = EventFd::from_flags(EfdFlags::EFD_CLOEXEC)
            .map_err(|errno| fd_error("an eventfd placeholder", errno))?;
        let path = file.path().to_owned();
        self.close(file);
        // SAFETY: `number` was closed just above by this thread and no other thread of the workload opens
        // files while it is parked (the main thread is locked out by the gate), so nothing else owns it; the
        // returned OwnedFd is its only owner.
        unsafe { dup3_raw(&eventfd, number, OFlag::O_CLOEXEC) }.map_err(|errno| WorkloadError::Fd {
            what: format!("an eventfd placeholder at fd {number} ({})", path.display()),
            source: errno.into(),
        })
    }

    /// The driver queries a park ends with and a resume starts with: nvidiactl and nvidia0 open for a
    /// moment, a root client, `REGISTER_FD`, a device and a subdevice, controls; all freed and closed again
    /// (park-program.jsonl.gz, pid 440 tid 462, after the root client's `RM_FREE` and before the resume).
    fn query_driver(&mut self) -> Result<(), WorkloadError> {
        let ctl = self.open("nvidiactl")?;
        let client = self.alloc(
            &ctl,
            AllocForm::Nvos64,
            [0, 0, 0],
            class::NV01_ROOT_CLIENT,
            None,
        )?;
        self.control_on(
            &ctl,
            client,
            client,
            ctrl::NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS,
        )?;
        let gpu = self.open("nvidia0")?;
        self.register_fd(&gpu, &ctl)?;
        let device = self.alloc(
            &ctl,
            AllocForm::Nvos21,
            [client, client, QUERY_HANDLE_BASE + 1],
            class::NV01_DEVICE_0,
            None,
        )?;
        self.control_on(
            &ctl,
            client,
            device,
            ctrl::NV0080_CTRL_CMD_GPU_GET_NUM_SUBDEVICES,
        )?;
        let subdevice = self.alloc(
            &ctl,
            AllocForm::Nvos21,
            [client, device, QUERY_HANDLE_BASE + 2],
            class::NV20_SUBDEVICE_0,
            None,
        )?;
        self.control_on(
            &ctl,
            client,
            subdevice,
            ctrl::NV2080_CTRL_CMD_GPU_GET_INFO_V2,
        )?;
        self.free_on(&ctl, client, device, subdevice)?;
        self.close(gpu);
        self.free_on(&ctl, client, client, device)?;
        self.free_on(&ctl, client, client, client)?;
        self.close(ctl);
        Ok(())
    }
}
