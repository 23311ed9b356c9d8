//! What a container's shim says of its processes' CUDA state during a preemption, and what the agent makes of
//! it (issue 39, item 3): after an agent restart every file its containers held is opaque (read from /proc,
//! its clients unknown), and a worker forked after CUDA init keeps its parent's files for good, so a park
//! would never be released. The shim ran the driver's checkpoint: it says which processes it checkpointed
//! (the `checkpointed` step's `pid`, the parked state's `pids`) and which the driver answered having no CUDA
//! state for (`no_cuda_state`, left alone). The tracer then takes the opaque files that were a checkpointed
//! process's and are held only by such processes now for files that carry nothing
//! (`baton_tracer::Tracer::clear_checkpointed_files`, which says what stays opaque).
//!
//! Trust: only the container's shim speaks here (the steps of the calls the agent makes to the control
//! socket it registered, and the state the registering shim pushes or registers), and only for the
//! container's own processes: a pid not in the container's cgroup tree now is left out. The word lasts for one
//! preemption: a resume (or a container running again) forgets it, as the restored processes have CUDA state
//! again.
use std::collections::BTreeSet;

use baton_agent_api::{ContainerRef, Phase, PreemptPhase, PreemptState};

use crate::{
    core::{Core, Note, NoteKind},
    holders::is_within,
};

/// What the shim said during a container's current preemption.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShimsWord {
    /// Processes it checkpointed: the driver freed their CUDA state (and CUDA closed its files).
    pub checkpointed: BTreeSet<u32>,
    /// Processes the driver has no CUDA state for (left alone by the preemption).
    pub left_alone: BTreeSet<u32>,
}

impl ShimsWord {
    /// What preemption state `state` (the shim's) says: a parked or snapshotted container's CUDA processes
    /// were checkpointed; any other state (running again, resuming) ends the word. `None` while the
    /// preemption runs (its steps speak).
    fn of_state(state: Option<&PreemptState>) -> Option<Self> {
        match state.map(|s| (s.state, s)) {
            Some((PreemptPhase::Parked | PreemptPhase::Snapshotted, s)) => Some(Self {
                checkpointed: s.pids.iter().copied().collect(),
                left_alone: s.no_cuda_state.iter().copied().collect(),
            }),
            Some((PreemptPhase::Preempting, _)) => None,
            Some((PreemptPhase::Resuming, _)) | None => Some(Self::default()),
        }
    }
}

impl Core {
    /// A step of a preemption, resume or handoff of `note.container`: shown to its traces; a `checkpointed`
    /// one (a checkpoint call returned) has the container's mirror checked against /proc at once and takes the
    /// shim's word (see the module comment).
    pub(crate) fn preemption_noted(&mut self, note: &Note) {
        self.note(note);
        let NoteKind::Preemption {
            phase: Phase::Checkpointed,
            pid,
            no_cuda_state,
            ..
        } = &note.kind
        else {
            return;
        };
        self.reconcile(std::slice::from_ref(&note.container));
        let Some(w) = self.watched.get_mut(&note.container) else {
            return;
        };
        w.shims_word.checkpointed.extend(pid.iter().copied());
        w.shims_word
            .left_alone
            .extend(no_cuda_state.iter().copied());
        self.take_shims_word(&note.container);
    }

    /// Container `c`'s preemption state changed (as its shim or the agent's own preemption set it): a parked
    /// container's word is taken (after a restart of the agent too, from the shim's registration), a running
    /// one's forgotten.
    pub(crate) fn preemption_state_changed(&mut self, c: &ContainerRef) {
        let Some(w) = self.watched.get_mut(c) else {
            return;
        };
        match ShimsWord::of_state(w.preemption.as_ref()) {
            Some(word) if word == ShimsWord::default() => {
                w.shims_word = word;
                return;
            }
            Some(word) => {
                w.shims_word.checkpointed.extend(word.checkpointed);
                w.shims_word.left_alone.extend(word.left_alone);
            }
            None => return,
        }
        // The records still in the ring first (a checkpointed process's closes among them).
        if self.drain_for_proc() {
            self.take_shims_word(c);
        }
    }

    /// Clears the opaque files of container `c` that its shim's word says carry nothing, and publishes what
    /// that changes (a release).
    fn take_shims_word(&mut self, c: &ContainerRef) {
        let (Some(tracer), Some(w)) = (self.tracer.as_mut(), self.watched.get_mut(c)) else {
            return;
        };
        if w.shims_word.checkpointed.is_empty() {
            return;
        }
        // The shim speaks for its own container's processes only.
        let cgroup = w.registration.cgroup.clone();
        let mine = |pid: &u32| {
            baton_tracer::cgroups::v2_path_of_pid(*pid).is_some_and(|p| is_within(&p, &cgroup))
        };
        let checkpointed: BTreeSet<u32> = w
            .shims_word
            .checkpointed
            .iter()
            .copied()
            .filter(mine)
            .collect();
        let mut no_state = checkpointed.clone();
        no_state.extend(w.shims_word.left_alone.iter().copied().filter(mine));
        let cleared = tracer.clear_checkpointed_files(w.cgroup_id, &checkpointed, &no_state);
        if cleared.is_empty() {
            return;
        }
        tracing::info!(
            id = c.id,
            namespace = c.namespace,
            files = cleared.len(),
            "agent: {} file(s) read from /proc carry no GPU state: their checkpointed process(es) {:?} let go \
             of them, and only process(es) {:?} without CUDA state hold them (the shim's word)",
            cleared.len(),
            checkpointed,
            no_state.difference(&checkpointed).collect::<Vec<_>>()
        );
        let bodies = w.update(tracer, &[], &self.classifier);
        let owner = w.owner;
        for body in bodies {
            self.publish(c, owner, body);
        }
        self.check_gates();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_agent_api::PreemptMode;

    fn state(phase: PreemptPhase) -> PreemptState {
        PreemptState {
            state: phase,
            mode: PreemptMode::Park,
            pids: vec![10],
            since_ns: 1,
            image_path: None,
            parked_for: None,
            idle_park: false,
            host_copy_bytes: None,
            raised_limit: None,
            unfrozen: false,
            no_cuda_state: vec![11],
        }
    }

    #[test]
    fn a_parked_state_is_the_word_a_running_or_resuming_one_ends_it() {
        let parked = ShimsWord::of_state(Some(&state(PreemptPhase::Parked))).unwrap();
        assert_eq!(parked.checkpointed, [10].into());
        assert_eq!(parked.left_alone, [11].into());
        assert_eq!(
            ShimsWord::of_state(Some(&state(PreemptPhase::Preempting))),
            None
        );
        assert_eq!(
            ShimsWord::of_state(Some(&state(PreemptPhase::Resuming))),
            Some(ShimsWord::default())
        );
        assert_eq!(ShimsWord::of_state(None), Some(ShimsWord::default()));
    }
}
