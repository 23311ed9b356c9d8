//! The control socket's `freeze` and `thaw`, as the node agent's co-runner controller sends them (one
//! connection, many lines), and the fail-safe when that connection ends: every hold it made is released.
use baton_agent_api::{FreezeRequest, Reply, Target};

use super::TaskService;
use crate::errors::ShimError;

impl TaskService {
    /// `freeze` from connection `conn`: freeze (or renew the hold of) the container, confirmed. Every hold
    /// has a lease: the default when the request has none, and one above the maximum is refused
    /// ([`baton_agent_api::freeze_lease`]).
    pub async fn freeze_for_agent(&self, r: FreezeRequest, conn: u64) -> Reply {
        let lease = match baton_agent_api::freeze_lease(r.lease_ms) {
            Ok(l) => l,
            Err(error) => return Reply::Error { error },
        };
        match self.target(&r.target) {
            Ok(c) => reply(c.hold(conn, Some(lease), r.renew).await),
            Err(e) => reply(Err(e)),
        }
    }

    /// `thaw` from connection `conn`: release the container's hold (whoever made it).
    pub async fn thaw_for_agent(&self, t: Target) -> Reply {
        match self.target(&t) {
            Ok(c) => reply(c.release_hold(None, "thaw").await),
            Err(e) => reply(Err(e)),
        }
    }

    /// Connection `conn` ended: the agent is gone (or restarting), so nothing it froze stays frozen.
    pub async fn agent_connection_ended(&self, conn: u64) {
        for c in self.shared.containers.all() {
            if !c.held_by(conn) {
                continue;
            }
            match c
                .release_hold(Some(conn), "the agent's connection ended")
                .await
            {
                Ok(_) => tracing::warn!(
                    id = %c.id,
                    "the agent's control connection ended while it held the container frozen: thawed (fail-safe)"
                ),
                Err(e) => tracing::warn!(id = %c.id, "thawing after the agent left: {e}"),
            }
        }
    }
}

fn reply(r: Result<baton_agent_api::FreezerReply, ShimError>) -> Reply {
    match r {
        Ok(f) => Reply::Freezer(f),
        Err(e) => Reply::Error {
            error: e.to_string(),
        },
    }
}
