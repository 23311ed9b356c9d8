//! `baton trace --summary`: per container, calls and latency per escape, errors, live objects by class and
//! GPU memory, and CUDA launches per entry point, printed when tracing ends.
use std::collections::BTreeMap;

use baton_nvidia::class;
use baton_tracer::{
    LaunchCounts, LaunchFn, Tracer,
    event::{Body, Event},
    schema::status_name,
};
use hdrhistogram::Histogram;

/// Latencies and errors of one escape in one container. A histogram (3 significant digits) keeps the
/// memory of a long trace bounded.
struct Calls {
    latencies: Histogram<u64>,
    errors: u64,
}

/// The longest latency the summary distinguishes (longer calls count as this): one hour, in ns.
const MAX_LATENCY_NS: u64 = 3_600_000_000_000;

impl Default for Calls {
    fn default() -> Self {
        let latencies = Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).unwrap_or_else(|_| {
            unreachable!("1 ns to 1 h at 3 significant digits are valid bounds")
        });
        Self {
            latencies,
            errors: 0,
        }
    }
}

/// Counts gathered while tracing.
#[derive(Default)]
pub struct Summary {
    by_container: BTreeMap<u64, BTreeMap<String, Calls>>,
    errors: BTreeMap<u64, BTreeMap<String, u64>>,
    launches: BTreeMap<u64, LaunchCounts>,
}

impl Summary {
    /// Counts one event.
    pub fn add(&mut self, e: &Event) {
        let Body::Ioctl(io) = &e.body else { return };
        let calls = self
            .by_container
            .entry(e.cgroup_id)
            .or_default()
            .entry(io.decoded.escape.to_string())
            .or_default();
        calls.latencies.saturating_record(io.latency_ns);
        let failed = io.ret != 0 || io.decoded.status.is_some_and(|s| s != 0);
        if failed {
            calls.errors += 1;
            let what = match (io.ret, io.decoded.status) {
                (0, Some(s)) => status_name(s, io.decoded.version),
                (r, _) => format!("errno {}", -r),
            };
            *self
                .errors
                .entry(e.cgroup_id)
                .or_default()
                .entry(what)
                .or_default() += 1;
        }
    }

    /// Counts launches of container `cgroup_id` (an interval's deltas).
    pub fn add_launches(&mut self, cgroup_id: u64, n: &LaunchCounts) {
        let total = self.launches.entry(cgroup_id).or_default();
        *total = total.plus(n);
    }

    /// The report, one block per container.
    pub fn render(&self, tracer: &mut Tracer) -> String {
        let mut out = String::new();
        let mut ids: Vec<u64> = self.by_container.keys().copied().collect();
        ids.extend(tracer.ledger().iter().map(|(id, _)| id));
        ids.extend(self.launches.keys().copied());
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            let name = tracer.container_name(id);
            out.push_str(&format!("\n== container {name} (cgroup {id})\n"));
            out.push_str(&format!(
                "{:<34} {:>8} {:>7} {:>12} {:>12}\n",
                "call", "calls", "errors", "p50 us", "p99 us"
            ));
            for (esc, c) in self.by_container.get(&id).into_iter().flatten() {
                let l = &c.latencies;
                out.push_str(&format!(
                    "{esc:<34} {:>8} {:>7} {:>12.1} {:>12.1}\n",
                    l.len(),
                    c.errors,
                    l.value_at_quantile(0.50) as f64 / 1000.0,
                    l.value_at_quantile(0.99) as f64 / 1000.0
                ));
            }
            if let Some(errs) = self.errors.get(&id) {
                let list: Vec<String> = errs.iter().map(|(k, v)| format!("{k} x{v}")).collect();
                out.push_str(&format!("errors: {}\n", list.join(", ")));
            }
            let state = tracer.gpu_state(id);
            if let Some(l) = tracer.ledger().container(id) {
                let live: Vec<String> = l
                    .live_by_class()
                    .iter()
                    .map(|(c, n)| {
                        format!(
                            "{}={n}",
                            class::name(*c).map_or_else(|| format!("0x{c:x}"), str::to_owned)
                        )
                    })
                    .collect();
                out.push_str(&format!(
                    "live objects: {} [{}]\nGPU memory held: {} bytes, peak {} (all memory classes: {} bytes){}\n",
                    l.live_objects(),
                    live.join(" "),
                    l.vram_bytes(),
                    l.peak_vram_bytes(),
                    l.memory_bytes(),
                    if l.partial { " (partial: some objects were allocated before tracing started)" } else { "" }
                ));
                out.push_str(&format!(
                    "uvm: initialized={} registered_gpus={} va_spaces={}\n",
                    l.uvm.initialized, l.uvm.gpus_registered, l.uvm.va_spaces_registered
                ));
                if l.doubts != Default::default() {
                    out.push_str(&format!(
                        "doubtful: {} allocation(s) counted though read as refused or rewritten ({} live), {} \
                         free(s) not believed\n",
                        l.doubts.allocations,
                        l.doubtful_objects(),
                        l.doubts.frees_disputed
                    ));
                }
            }
            out.push_str(&format!(
                "open NVIDIA fds: {}, device mappings: {}\n",
                state.open_fds, state.mappings
            ));
            if let Some(n) = self.launches.get(&id) {
                let per_fn: Vec<String> = LaunchFn::ALL
                    .iter()
                    .map(|f| format!("{} {}", f.symbol(), n.get(*f)))
                    .collect();
                out.push_str(&format!("launches: {}\n", per_fn.join(", ")));
            }
        }
        out
    }
}
