//! What each hook does. The stages follow the runtime spec's order: `createRuntime` (the container's
//! namespaces and cgroup exist, its mounts are made, `pivot_root` and its program are still to come)
//! registers it; `poststart` (its program runs) confirms that the agent watches it, registering it late
//! when the agent was not there at create; `poststop` unregisters it. `wait-gpu-free` is a createRuntime
//! hook too: the last stage that runs in the runtime's namespaces (where the agent's socket is) before
//! the program runs. createContainer and startContainer hooks run inside the container's mount namespace
//! (startContainer after `pivot_root`, where neither this binary nor the socket is), and poststart is
//! too late: the program already runs.
use std::time::Duration;

use baton_agent_api::{ContainerRef, DURATION_SYNTAX, Registration, parse_duration};

use crate::{
    agent::Agent,
    container::{RootView, namespace_of, registration_of},
    error::HookError,
    outcome::{EXIT_AGENT, Outcome},
    state::HookState,
};

/// The annotation that sets the gate's timeout when `--timeout` is not given (the shim's key).
pub const WAIT_GPU_FREE_ANNOTATION: &str = "baton.io/wait-gpu-free";

/// What every stage is told.
#[derive(Clone, Debug)]
pub struct Options {
    /// The agent.
    pub agent: Agent,
    /// `--namespace`, if given.
    pub namespace: Option<String>,
    /// The device path prefix the probes follow (`/dev/nvidia`).
    pub trace_prefix: String,
    /// Fail the container (exit 1) when the agent cannot watch it.
    pub require_agent: bool,
}

impl Options {
    fn container(&self, state: &HookState) -> ContainerRef {
        ContainerRef {
            id: state.id.clone(),
            namespace: namespace_of(self.namespace.as_deref(), &state.annotations),
        }
    }

    fn agent_error(state: &HookState, source: crate::agent::AgentError) -> HookError {
        HookError::Agent {
            id: state.id.clone(),
            source,
        }
    }

    /// Registers `state` as seen from `view`; what happened (`None`: it sees no NVIDIA device), or the
    /// error.
    async fn register(
        &self,
        state: &HookState,
        view: RootView,
    ) -> Result<Option<String>, HookError> {
        match registration_of(state, self.container(state), &self.trace_prefix, view)? {
            Some(registration) => self.send(state, registration).await.map(Some),
            None => Ok(None),
        }
    }

    /// Sends `registration`; what the agent watches now.
    async fn send(
        &self,
        state: &HookState,
        registration: Registration,
    ) -> Result<String, HookError> {
        let c = registration.container.clone();
        let entry = self
            .agent
            .register(registration)
            .await
            .map_err(|e| Self::agent_error(state, e))?;
        Ok(format!(
            "the agent watches container {} (namespace {}, cgroup {}, devices {})",
            c.id,
            c.namespace,
            entry.cgroup,
            entry.devices.join(" ")
        ))
    }

    fn unwatched(&self, state: &HookState) -> String {
        format!(
            "container {} sees no NVIDIA device file in {}: not watched",
            state.id,
            baton_agent_api::device_dir(&self.trace_prefix)
        )
    }
}

/// createRuntime: the agent watches the container before its program runs.
pub async fn create_runtime(o: &Options, state: &HookState) -> Outcome {
    match o.register(state, RootView::BeforePivot).await {
        Ok(Some(done)) => Outcome::Done(done),
        Ok(None) => Outcome::Done(o.unwatched(state)),
        Err(e) => Outcome::of_error(&e, o.require_agent),
    }
}

/// poststart: confirms the agent watches the container, registering it when it does not (no agent at
/// create, or one restarted since). A program that exited already is no error.
pub async fn poststart(o: &Options, state: &HookState) -> Outcome {
    let c = o.container(state);
    let registration =
        match registration_of(state, c.clone(), &o.trace_prefix, RootView::AfterPivot) {
            Ok(Some(r)) => r,
            Ok(None) => return Outcome::Done(o.unwatched(state)),
            Err(e @ HookError::ProcessGone { .. }) => return Outcome::Warning(e.to_string()),
            Err(e) => return Outcome::of_error(&e, o.require_agent),
        };
    match o.agent.watches(&c).await {
        Ok(true) => Outcome::Done(format!(
            "the agent watches container {} (namespace {})",
            c.id, c.namespace
        )),
        Ok(false) => match o.send(state, registration).await {
            Ok(done) => Outcome::Done(format!("registered after start: {done}")),
            Err(e) => Outcome::of_error(&e, o.require_agent),
        },
        Err(e) => Outcome::of_error(&Options::agent_error(state, e), o.require_agent),
    }
}

/// poststop: the agent stops watching the container.
pub async fn poststop(o: &Options, state: &HookState) -> Outcome {
    let c = o.container(state);
    match o.agent.unregister(c.clone()).await {
        Ok(true) => Outcome::Done(format!(
            "the agent no longer watches container {} (namespace {})",
            c.id, c.namespace
        )),
        Ok(false) => Outcome::Done(format!(
            "the agent did not watch container {} (namespace {})",
            c.id, c.namespace
        )),
        Err(e) if o.require_agent => Outcome::of_error(&Options::agent_error(state, e), true),
        Err(e) => Outcome::Warning(format!(
            "{}; an agent drops it by itself once its processes are gone",
            Options::agent_error(state, e)
        )),
    }
}

/// The gate's timeout: `flag`, else the container's [`WAIT_GPU_FREE_ANNOTATION`].
pub fn gate_timeout(state: &HookState, flag: Option<&str>) -> Result<Duration, HookError> {
    let (origin, value) = match (flag, state.annotations.get(WAIT_GPU_FREE_ANNOTATION)) {
        (Some(v), _) => ("--timeout", v),
        (None, Some(v)) => ("annotation baton.io/wait-gpu-free", v.as_str()),
        (None, None) => {
            return Err(HookError::NoTimeout {
                id: state.id.clone(),
                syntax: DURATION_SYNTAX,
            });
        }
    };
    parse_duration(value).ok_or_else(|| HookError::BadDuration {
        id: state.id.clone(),
        origin,
        value: value.to_owned(),
        syntax: DURATION_SYNTAX,
    })
}

/// wait-gpu-free (createRuntime): registers the container, then waits until no other watched container
/// holds a GPU device it sees, at most `timeout`; past it (or without an agent to ask) it fails, which
/// makes the runtime fail the container's start, naming the holder.
pub async fn wait_gpu_free(o: &Options, state: &HookState, timeout: Option<&str>) -> Outcome {
    let within = match gate_timeout(state, timeout) {
        Ok(d) => d,
        Err(e) => return Outcome::of_error(&e, true),
    };
    let failed = |e: HookError| Outcome::Failed {
        status: if e.is_bad_input() {
            crate::outcome::EXIT_BAD_INPUT
        } else {
            EXIT_AGENT
        },
        message: format!("waiting for a free GPU: {e}"),
    };
    match o.register(state, RootView::BeforePivot).await {
        Ok(Some(_)) => {}
        Ok(None) => {
            return Outcome::Done(format!("{}: nothing to wait for", o.unwatched(state)));
        }
        Err(e) => return failed(e),
    }
    match o.agent.wait_gpu_free(o.container(state), within).await {
        Ok(waited_ns) => Outcome::Done(format!(
            "the GPU is free for container {} (waited {:?})",
            state.id,
            Duration::from_nanos(waited_ns)
        )),
        Err(e) => failed(Options::agent_error(state, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(annotations: &[(&str, &str)]) -> HookState {
        HookState {
            id: "c1".into(),
            pid: None,
            bundle: "/nonexistent".into(),
            annotations: annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn the_gate_timeout_is_the_flag_else_the_annotation_in_one_syntax() {
        let s = state(&[(WAIT_GPU_FREE_ANNOTATION, "2m")]);
        assert_eq!(
            gate_timeout(&s, Some("500ms")).unwrap(),
            Duration::from_millis(500)
        );
        assert_eq!(gate_timeout(&s, None).unwrap(), Duration::from_secs(120));
        let e = gate_timeout(&state(&[]), None).unwrap_err().to_string();
        assert!(e.contains("needs a timeout"), "{e}");
        let e = gate_timeout(&s, Some("soon")).unwrap_err().to_string();
        assert!(e.contains("--timeout \"soon\"") && e.contains("20s"), "{e}");
    }
}
