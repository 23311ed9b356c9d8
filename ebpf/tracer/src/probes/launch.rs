//! The launch uprobes of the probe set: loading the three programs, attaching them to one libcuda file, and
//! reading the per-container counters they keep (`LAUNCHES`, per CPU, summed here).
use std::{fs::File, os::fd::AsRawFd, path::Path};

use aya::{
    Ebpf,
    maps::{MapData, PerCpuHashMap},
    programs::{UProbe, uprobe::UProbeScope},
};
use baton_probe_common::{LaunchCounts, LaunchFn, maps};

use super::{ProbeError, Probes, error_chain, map_err};

/// The counters map, typed.
pub type LaunchMap = PerCpuHashMap<MapData, u64, LaunchCounts>;

/// Loads (without attaching) the three uprobe programs and takes the counters map.
pub(super) fn load(ebpf: &mut Ebpf) -> Result<LaunchMap, ProbeError> {
    for f in LaunchFn::ALL {
        uprobe(ebpf, f)?.load().map_err(|e| {
            ProbeError::Refused(format!("loading {}: {}", f.program(), error_chain(&e)))
        })?;
    }
    let map = ebpf
        .take_map(maps::LAUNCHES)
        .ok_or(ProbeError::MissingMap(maps::LAUNCHES))?;
    PerCpuHashMap::try_from(map).map_err(map_err(maps::LAUNCHES))
}

fn uprobe(ebpf: &mut Ebpf, f: LaunchFn) -> Result<&mut UProbe, ProbeError> {
    ebpf.program_mut(f.program())
        .ok_or_else(|| {
            ProbeError::Refused(format!("program {} missing from the object", f.program()))
        })?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| ProbeError::Refused(e.to_string()))
}

impl Probes {
    /// Attaches the launch uprobes to the entry points that the open ELF file `library` exports (its dynamic
    /// symbol table); they fire for every process that maps that file, and stay attached until the probe set
    /// is dropped. The file is read and named to the kernel as `/proc/self/fd/N`, which resolves to that
    /// open file whatever its path leads to now; `shown` names it in errors. Returns the entry points
    /// probed; an error only when none could be.
    pub fn attach_launch_probes(
        &mut self,
        library: &File,
        shown: &Path,
    ) -> Result<Vec<LaunchFn>, ProbeError> {
        let through_fd = format!("/proc/self/fd/{}", library.as_raw_fd());
        let mut probed = Vec::new();
        let mut errors = Vec::new();
        for f in LaunchFn::ALL {
            let attached = uprobe(&mut self._ebpf, f)?.attach(
                f.symbol(),
                Path::new(&through_fd),
                UProbeScope::AllProcesses,
            );
            match attached {
                Ok(_) => probed.push(f),
                Err(e) => errors.push(format!("{}: {}", f.symbol(), error_chain(&e))),
            }
        }
        if probed.is_empty() {
            return Err(ProbeError::Uprobe {
                library: shown.to_owned(),
                detail: errors.join("; "),
            });
        }
        if !errors.is_empty() {
            tracing::debug!(library = %shown.display(), "some launch entry points not probed: {}", errors.join("; "));
        }
        Ok(probed)
    }

    /// Launches counted for cgroup `cgroup_id` (zero when it launched none).
    pub fn launch_counts(&self, cgroup_id: u64) -> LaunchCounts {
        self.launches
            .get(&cgroup_id, 0)
            .map(|per_cpu| sum(per_cpu.iter()))
            .unwrap_or_default()
    }

    /// Every cgroup with counted launches, and its counts.
    pub fn all_launch_counts(&self) -> Vec<(u64, LaunchCounts)> {
        self.launches
            .iter()
            .flatten()
            .map(|(id, per_cpu)| (id, sum(per_cpu.iter())))
            .collect()
    }

    /// Drops the counters of cgroup `cgroup_id` (they start from zero if it launches again).
    pub fn forget_launches(&mut self, cgroup_id: u64) {
        let _ = self.launches.remove(&cgroup_id);
    }
}

fn sum<'a>(per_cpu: impl Iterator<Item = &'a LaunchCounts>) -> LaunchCounts {
    per_cpu.fold(LaunchCounts::default(), |acc, c| acc.plus(c))
}
