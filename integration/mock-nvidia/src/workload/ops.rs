//! The workload's single calls with their bookkeeping: each opens, closes or sends one thing through
//! [`super::calls`], counts it in the [`super::Summary`], and turns a non-`NV_OK` status into an error.

use std::os::fd::OwnedFd;

use baton_nvidia::{class, ctrl, escape, status, uvm};

use super::calls::{self, AllocForm};
use super::nvfile::NvFile;
use super::session::{Handles, Session, WORKLOAD_HANDLE_BASE, Workload};
use super::summary::FailedCall;
use super::{WorkloadError, park};

/// Bytes of the scratch buffer passed as control params (the mock does not read them).
const CONTROL_PARAMS_BYTES: usize = 64;

impl Workload {
    pub(super) fn device_path(&self, name: &str) -> std::path::PathBuf {
        self.options.dev_dir.join(name)
    }

    pub(super) fn open(&mut self, name: &str) -> Result<NvFile, WorkloadError> {
        let file = NvFile::open(&self.device_path(name))?;
        *self.summary.fds_opened.entry(name.to_owned()).or_default() += 1;
        Ok(file)
    }

    /// Opens `name`; with a `placeholder`, the file goes onto the placeholder's fd number (dup3 over it)
    /// and the temporary fd is closed, as the H200's resume put the uvm fds back
    /// (/work/shared/gpu/580.159.04/park-program.jsonl.gz, pid 440 tid 462: open, dup, close).
    pub(super) fn open_onto(
        &mut self,
        name: &str,
        placeholder: Option<OwnedFd>,
    ) -> Result<NvFile, WorkloadError> {
        let file = self.open(name)?;
        let Some(placeholder) = placeholder else {
            return Ok(file);
        };
        let onto = park::dup_onto(&file, placeholder)?;
        self.close(file);
        Ok(onto)
    }

    /// Closes `file` (its fd; the file itself lives on while a mapping or another fd holds it).
    pub(super) fn close(&mut self, file: NvFile) {
        drop(file);
        self.summary.fds_closed += 1;
    }

    pub(super) fn register_fd(&mut self, gpu: &NvFile, ctl: &NvFile) -> Result<(), WorkloadError> {
        calls::register_fd(gpu, ctl.raw_fd())?;
        self.count_escape(escape::REGISTER_FD);
        Ok(())
    }

    pub(super) fn require_session(&self) -> Result<&Session, WorkloadError> {
        self.session.as_ref().ok_or(WorkloadError::NotSetUp)
    }

    pub(super) fn require_session_mut(&mut self) -> Result<&mut Session, WorkloadError> {
        self.session.as_mut().ok_or(WorkloadError::NotSetUp)
    }

    pub(super) fn set_handles(
        &mut self,
        set: impl FnOnce(&mut Handles),
    ) -> Result<(), WorkloadError> {
        set(&mut self.require_session_mut()?.handles);
        Ok(())
    }

    pub(super) fn count_escape(&mut self, nr: u32) {
        let name = escape::name(nr).unwrap_or("unknown").to_owned();
        *self.summary.escapes.entry(name).or_default() += 1;
    }

    /// Records a non-`NV_OK` status and turns it into an error.
    pub(super) fn check(&mut self, call: &str, code: u32) -> Result<(), WorkloadError> {
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

    pub(super) fn alloc_under(
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

    pub(super) fn alloc_with_handle(
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

    pub(super) fn alloc(
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

    /// `RM_FREE` through the session's nvidiactl.
    pub(super) fn free(
        &mut self,
        client: u32,
        parent: u32,
        object: u32,
    ) -> Result<(), WorkloadError> {
        let session = self.session.take().ok_or(WorkloadError::NotSetUp)?;
        let result = self.free_on(&session.ctl, client, parent, object);
        self.session = Some(session);
        result
    }

    /// `RM_FREE` through `ctl` (the client itself when `object == client`).
    pub(super) fn free_on(
        &mut self,
        ctl: &NvFile,
        client: u32,
        parent: u32,
        object: u32,
    ) -> Result<(), WorkloadError> {
        let code = calls::rm_free(ctl, client, parent, object)?;
        self.count_escape(escape::RM_FREE);
        self.check("RM_FREE", code)?;
        self.summary.frees += 1;
        Ok(())
    }

    pub(super) fn unmap(
        &mut self,
        handles: Handles,
        memory: u32,
        linear_address: u64,
    ) -> Result<u32, WorkloadError> {
        let session = self.require_session()?;
        let code = calls::rm_unmap_memory(
            &session.ctl,
            [handles.client, handles.device, memory],
            linear_address,
        )?;
        self.count_escape(escape::RM_UNMAP_MEMORY);
        Ok(code)
    }

    /// `RM_CONTROL` through the session's nvidiactl, on the session's client.
    pub(super) fn control(&mut self, object: u32, cmd: u32) -> Result<(), WorkloadError> {
        let session = self.session.take().ok_or(WorkloadError::NotSetUp)?;
        let result = self.control_on(&session.ctl, session.handles.client, object, cmd);
        self.session = Some(session);
        result
    }

    /// `RM_CONTROL` `cmd` on `client`'s `object` through `ctl`.
    pub(super) fn control_on(
        &mut self,
        ctl: &NvFile,
        client: u32,
        object: u32,
        cmd: u32,
    ) -> Result<(), WorkloadError> {
        let mut params = [0u8; CONTROL_PARAMS_BYTES];
        let code = calls::rm_control(ctl, client, object, cmd, &mut params)?;
        self.count_escape(escape::RM_CONTROL);
        self.summary.controls += 1;
        let name = ctrl::name(cmd).unwrap_or("unknown control");
        self.check(&format!("RM_CONTROL {name}"), code)
    }

    /// Sends UVM `cmd` on `file` with params filled by `fill`, if the command exists in this band.
    pub(super) fn uvm(
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
