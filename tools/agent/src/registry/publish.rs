//! What the registry tells others: each container's transitions as events on the agent's stream (numbered,
//! the released signal also counted for the metrics), and the watched containers as the co-runner
//! controller's members.
use baton_agent_api::{ContainerRef, Event, EventBody};
use baton_tracer::now_monotonic_ns;

use crate::{control, core::Core, metrics::events::events};

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
        if let EventBody::Released(r) = &event.body {
            events().released(r, event.t_ns);
        }
        // No watcher is not an error: the state is in `status`.
        let _ = self.events.send(Published { event, owner });
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
