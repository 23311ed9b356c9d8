//! One task per controlled container: a connection to its shim's control socket that stays open (the shim
//! releases every freeze of a connection that ends, so an agent that dies leaves nothing frozen), the
//! latest wanted state applied (older ones are skipped), and the freeze renewed before its lease lapses.
use std::{path::PathBuf, time::Duration};

use baton_agent_api::{
    Client, ClientError, ContainerRef, FreezeRequest, FreezerReply, Reply, Request, Target,
};
use tokio::sync::{mpsc, oneshot};

use crate::sleep_until_opt;

/// What the controller asks of a link.
pub struct Want {
    /// Frozen or running.
    pub frozen: bool,
    /// Who waits for the shim's answer (`baton freeze`), if anyone.
    pub answer: Option<oneshot::Sender<Result<FreezerReply, String>>>,
}

/// What a link tells the controller after each change.
#[derive(Debug)]
pub struct Report {
    /// Which container.
    pub container: ContainerRef,
    /// The shim's answer, or why there is none.
    pub result: Result<FreezerReply, String>,
    /// Whether that was a freeze (or a thaw).
    pub freeze: bool,
}

/// Starts the link of `container`; its reports go to `reports`.
pub fn spawn(
    container: ContainerRef,
    socket: PathBuf,
    lease: Duration,
    reports: mpsc::UnboundedSender<Report>,
) -> mpsc::UnboundedSender<Want> {
    let (tx, rx) = mpsc::unbounded_channel();
    let link = Link {
        container,
        socket,
        lease,
        client: None,
    };
    tokio::spawn(link.run(rx, reports));
    tx
}

struct Link {
    container: ContainerRef,
    socket: PathBuf,
    lease: Duration,
    client: Option<Client>,
}

impl Link {
    async fn run(
        mut self,
        mut wants: mpsc::UnboundedReceiver<Want>,
        reports: mpsc::UnboundedSender<Report>,
    ) {
        let mut frozen = false;
        loop {
            let renew = frozen.then(|| tokio::time::Instant::now() + self.lease / 3);
            let first = tokio::select! {
                w = wants.recv() => match w {
                    Some(w) => Some(w),
                    None => return,
                },
                () = sleep_until_opt(renew) => None,
            };
            let Some(first) = first else {
                // Renew the lease. A renewal never freezes again: a hold that ended (for an exec or a kill)
                // is reported thawed, and a failure is reported like any other.
                match self.call(true, true).await {
                    Ok(r) if r.frozen => {}
                    result => {
                        frozen = false;
                        let _ = reports.send(self.report(result, true));
                    }
                }
                continue;
            };
            // The latest wish wins; everyone who waited gets its outcome.
            let mut answers: Vec<_> = first.answer.into_iter().collect();
            let mut want = first.frozen;
            while let Ok(w) = wants.try_recv() {
                want = w.frozen;
                answers.extend(w.answer);
            }
            let result = self.call(want, false).await;
            frozen = want && result.as_ref().is_ok_and(|r| r.frozen);
            for a in answers {
                let _ = a.send(result.clone());
            }
            let _ = reports.send(self.report(result, want));
        }
    }

    fn report(&self, result: Result<FreezerReply, String>, freeze: bool) -> Report {
        Report {
            container: self.container.clone(),
            result,
            freeze,
        }
    }

    /// Sends one freeze (`renew`: of the hold in force only) or thaw, connecting first if need be (once more
    /// after a broken connection).
    async fn call(&mut self, freeze: bool, renew: bool) -> Result<FreezerReply, String> {
        let request = if freeze {
            Request::Freeze(FreezeRequest {
                target: Target::exact(&self.container),
                hold_ms: None,
                lease_ms: Some(u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX)),
                renew,
            })
        } else {
            Request::Thaw(Target::exact(&self.container))
        };
        for attempt in 0..2 {
            if self.client.is_none() {
                let c = Client::connect(&self.socket).await.map_err(|e| {
                    format!(
                        "cannot reach the shim of {} at {}: {e}",
                        self.container.id,
                        self.socket.display()
                    )
                })?;
                self.client = Some(c);
            }
            let Some(client) = self.client.as_mut() else {
                continue;
            };
            match client.call(request.clone()).await {
                Ok(Reply::Freezer(r)) => return Ok(r),
                Ok(other) => return Err(format!("unexpected reply from the shim: {other:?}")),
                Err(ClientError::Refused(e)) => return Err(e),
                Err(e) => {
                    self.client = None;
                    if attempt == 1 {
                        return Err(format!("the shim of {} is gone: {e}", self.container.id));
                    }
                }
            }
        }
        Err("unreachable shim".to_owned())
    }
}
