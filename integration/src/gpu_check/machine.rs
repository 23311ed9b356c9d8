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
