//! What the registry tells others: each container's transitions as events on the agent's stream (numbered,
//! the released signal also counted for the metrics), each release's NVML cross-check after it (never
//! before it: see [`crate::nvml`]), and the watched containers as the co-runner controller's members.
use baton_agent_api::{ContainerRef, Event, EventBody, NvmlView};
use baton_tracer::now_monotonic_ns;

use crate::{
    control,
    core::Core,
    metrics::events::events,
    nvml::{self, Checked, Pending},
};

/// An event on its way to the watchers, with the pid of the process that registered its container.
#[derive(Clone, Debug)]
pub struct Published {
    /// The event.
    pub event: Event,
    /// Who registered the container (for `watch {"mine": true}`).
    pub owner: u32,
}

impl Core {
    /// Publishes a transition of container `c` (registered by `owner`) on the event stream.
    pub(crate) fn publish(&mut self, c: &ContainerRef, owner: u32, body: EventBody) {
        self.seq += 1;
        match &body {
            EventBody::Acquired(a) => {
                tracing::info!(id = c.id, pid = a.pid, "agent: container acquired the GPU");
                self.park_again_if_parked(c);
            }
            EventBody::Released(r) => {
                tracing::info!(
                    id = c.id,
                    t_last_close_ns = r.t_last_close_ns,
                    t_released_ns = r.t_released_ns,
                    confirmed_by = r.confirmed_by,
                    "agent: container released the GPU"
                );
                self.gapfill.released(c);
            }
            _ => {}
        }
        let event = Event {
            seq: self.seq,
            t_ns: now_monotonic_ns(),
            container: c.clone(),
            body,
        };
        let check = match &event.body {
            EventBody::Released(r) => {
                events().released(r, event.t_ns);
                Some(Pending {
                    container: c.clone(),
                    owner,
                    released_seq: event.seq,
                    t_released_ns: r.t_released_ns,
                    pids: r.pids.clone(),
                })
            }
            _ => None,
        };
        // No watcher is not an error: the state is in `status`.
        let _ = self.events.send(Published { event, owner });
        // NVML is asked after the release went out, off this thread; a check dropped to make room goes now.
        let released = check.is_some();
        if let Some(dropped) = check.and_then(nvml::check_later) {
            self.publish_nvml_check(dropped);
        }
        if released {
            // A GPU left with no holder gives the floor a reading of its idle memory (`gate/floor.rs`): asked
            // once the gates were checked with the release, so that the Start it lets through waits for one
            // NVML query, not for this one and then another asked after its holders went.
            self.floor.wanted = true;
        }
    }

    /// Publishes NVML's cross-check of a release (`nvml_check`), logging what NVML still lists among the
    /// released pids: after a release it should list none of them.
    pub(crate) fn publish_nvml_check(&mut self, checked: Checked) {
        let (c, owner, check) = checked.into_event();
        match &check.nvml {
            NvmlView::Seen(seen) if !seen.processes.is_empty() => tracing::warn!(
                id = c.id,
                released_seq = check.released_seq,
                "agent: NVML still lists released processes {:?} {} us after the release was confirmed",
                seen.processes,
                check
                    .t_asked_ns
                    .saturating_sub(check.t_released_ns)
                    .saturating_add(check.took_ns)
                    / 1_000
            ),
            NvmlView::Missing(why) => tracing::debug!(
                id = c.id,
                released_seq = check.released_seq,
                "agent: no NVML cross-check of the release: {why:?}"
            ),
            NvmlView::Seen(_) => {}
        }
        self.publish(&c, owner, EventBody::NvmlCheck(check));
    }

    /// Tells the controller the watched containers, when they changed.
    pub(crate) fn publish_members(&mut self) {
        let members: Vec<control::Member> = self
            .watched
            .values()
            .map(|w| control::Member {
                container: w.registration.container.clone(),
                role: w.registration.role.clone(),
                control_socket: w.registration.control_socket.clone(),
            })
            .collect();
        if members != self.members_sent {
            self.controller.members(members.clone());
            self.members_sent = members;
        }
    }
}
