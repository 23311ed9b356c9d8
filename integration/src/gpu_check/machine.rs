//! What the machine has, asked before anything runs on it: the GPUs as `nvidia-smi` lists them (for the
//! report; a missing or failing `nvidia-smi` is only noted) and whether `python3` has PyTorch with CUDA (the
//! PyTorch programs of the trace and checkpoint parts need it: without it those parts are unavailable, not
//! failed). Each question is a bounded run of the program.
use std::process::Command;

use serde::Serialize;

use super::{bounded, bounds::Bounds};

/// The machine, as far as it could be asked.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Machine {
    /// `nvidia-smi`'s name, total memory, driver version and bus id of each GPU.
    pub gpus: Vec<String>,
    /// Why `nvidia-smi` gave nothing, when it did not.
    pub nvidia_smi_unavailable: Option<String>,
    /// PyTorch's version, its CUDA version and the devices it sees.
    pub torch: Option<String>,
    /// Why the PyTorch programs cannot run, when they cannot.
    pub torch_unavailable: Option<String>,
}

/// Asks `nvidia-smi` and `python` (its PyTorch).
pub fn survey(python: &str, bounds: &Bounds) -> Machine {
    let mut machine = Machine::default();
    match bounded::run(
        Command::new("nvidia-smi").args([
            "--query-gpu=name,memory.total,driver_version,pci.bus_id",
            "--format=csv,noheader",
        ]),
        bounds.within(bounds.command),
    )
    .and_then(|f| f.succeeded("nvidia-smi"))
    {
        Ok(f) => machine.gpus = f.stdout.lines().map(|l| l.trim().to_owned()).collect(),
        Err(why) => machine.nvidia_smi_unavailable = Some(why),
    }
    match torch_with_cuda(python, bounds) {
        Ok(torch) => machine.torch = Some(torch),
        Err(why) => machine.torch_unavailable = Some(why),
    }
    machine
}

/// PyTorch's version and devices in `python`; `Err` says why it cannot run the kit's programs.
fn torch_with_cuda(python: &str, bounds: &Bounds) -> Result<String, String> {
    let probe = "import torch; print(torch.__version__, torch.version.cuda, \
                 int(torch.cuda.is_available()), torch.cuda.device_count())";
    let found = bounded::run(
        Command::new(python).args(["-c", probe]),
        bounds.within(bounds.program_ready),
    )
    .and_then(|f| f.succeeded(&format!("`{python} -c 'import torch'`")))?;
    let fields: Vec<&str> = found.stdout.split_whitespace().collect();
    let [version, cuda, available, count] = fields[..] else {
        return Err(format!(
            "`{python}` printed {:?} for PyTorch's version and devices",
            found.stdout.trim()
        ));
    };
    if available != "1" {
        return Err(format!(
            "PyTorch {version} in `{python}` sees no CUDA device (built for CUDA {cuda})"
        ));
    }
    Ok(format!(
        "PyTorch {version} (CUDA {cuda}), {count} device(s)"
    ))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    /// A stand-in `python3` printing `line` (or failing with `error`) for the PyTorch question.
    fn python_printing(dir: &std::path::Path, body: &str) -> String {
        let path = dir.join("python3");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    }

    #[test]
    fn pytorch_without_cuda_missing_or_broken_makes_the_programs_unavailable() {
        let dir = tempfile::tempdir().unwrap();
        let bounds = Bounds::new(true, None);
        let with_gpu = python_printing(dir.path(), "echo 2.11.0 13.0 1 1");
        assert_eq!(
            torch_with_cuda(&with_gpu, &bounds).unwrap(),
            "PyTorch 2.11.0 (CUDA 13.0), 1 device(s)"
        );
        let no_gpu = python_printing(dir.path(), "echo 2.11.0 13.0 0 0");
        assert_eq!(
            torch_with_cuda(&no_gpu, &bounds).unwrap_err(),
            format!("PyTorch 2.11.0 in `{no_gpu}` sees no CUDA device (built for CUDA 13.0)")
        );
        let no_torch = python_printing(
            dir.path(),
            "echo \"ModuleNotFoundError: No module named 'torch'\" >&2; exit 1",
        );
        let why = torch_with_cuda(&no_torch, &bounds).unwrap_err();
        assert!(
            why.ends_with(": ModuleNotFoundError: No module named 'torch'"),
            "{why}"
        );
        let why = torch_with_cuda("/nonexistent/python3", &bounds).unwrap_err();
        assert!(why.starts_with("cannot run /nonexistent/python3"), "{why}");
    }
}
