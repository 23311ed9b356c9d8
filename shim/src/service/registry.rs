//! The shim's containers by id. An id is reserved before Create does anything, so two Creates of
//! one id cannot both go ahead (the second is refused with AlreadyExists), and a failed Create
//! frees its id again.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use crate::{
    container::Container,
    errors::{Result, ShimError},
};

enum Slot {
    /// Create is running for this id.
    Creating,
    Ready(Arc<Container>),
}

/// Containers by id, including those still being created.
#[derive(Default)]
pub struct Registry {
    slots: Mutex<HashMap<String, Slot>>,
}

/// An id held for a Create in progress; dropped without [`Reservation::fill`], it frees the id.
pub struct Reservation<'a> {
    registry: &'a Registry,
    id: String,
    filled: bool,
}

impl Registry {
    fn slots(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `id` for a Create; AlreadyExists when a container has it or is being created.
    pub fn reserve(&self, id: &str) -> Result<Reservation<'_>> {
        let mut slots = self.slots();
        if slots.contains_key(id) {
            return Err(ShimError::AlreadyExists {
                what: "container",
                id: id.to_string(),
            });
        }
        slots.insert(id.to_string(), Slot::Creating);
        Ok(Reservation {
            registry: self,
            id: id.to_string(),
            filled: false,
        })
    }

    /// The created container `id`.
    pub fn get(&self, id: &str) -> Result<Arc<Container>> {
        match self.slots().get(id) {
            Some(Slot::Ready(c)) => Ok(c.clone()),
            _ => Err(ShimError::ContainerNotFound { id: id.to_string() }),
        }
    }

    /// Every created container.
    pub fn all(&self) -> Vec<Arc<Container>> {
        self.slots()
            .values()
            .filter_map(|s| match s {
                Slot::Ready(c) => Some(c.clone()),
                Slot::Creating => None,
            })
            .collect()
    }

    /// Forgets `id` (after Delete).
    pub fn remove(&self, id: &str) {
        self.slots().remove(id);
    }

    /// No container, created or being created.
    pub fn is_empty(&self) -> bool {
        self.slots().is_empty()
    }
}

impl Reservation<'_> {
    /// Puts the created container in its slot.
    pub fn fill(mut self, container: Arc<Container>) {
        self.registry
            .slots()
            .insert(self.id.clone(), Slot::Ready(container));
        self.filled = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.filled {
            self.registry.slots().remove(&self.id);
        }
    }
}
