//! The per-container ledger of GPU driver state: live RM objects by class, GPU memory allocated through
//! memory classes, and UVM state, kept from the decoded calls of the container's processes.
//!
//! Driver semantics it follows (nvidia-driver.md): a successful RM_FREE frees the object and its subtree, and
//! freeing a client frees the client's whole tree; RM objects belong to the file they were allocated through,
//! so when a process no longer pins any NVIDIA file (no fd, no mapping) the driver has released everything it
//! allocated. This is what issue C's release signal reads: [`ContainerLedger::holds_gpu_objects`].
use std::collections::{BTreeMap, HashMap};

use baton_nvidia::{class, decode::Op, status};

/// An RM object the ledger believes is live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmObject {
    /// Its class.
    pub class: u32,
    /// Parent handle (the client's own handle for top-level objects).
    pub parent: u32,
    /// Bytes of memory it holds (memory classes), else 0.
    pub bytes: u64,
    /// The process that allocated it.
    pub owner: u32,
}

/// UVM state of a container.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct UvmState {
    /// Successful UVM_INITIALIZE calls not undone.
    pub initialized: u32,
    /// UVM_MM_INITIALIZE calls.
    pub mm_initialized: u32,
    /// GPUs registered with UVM.
    pub gpus_registered: i64,
    /// GPU VA spaces registered with UVM.
    pub va_spaces_registered: i64,
}

/// GPU driver state of one container (cgroup).
#[derive(Clone, Debug, Default)]
pub struct ContainerLedger {
    /// Live objects by (client, handle); a client itself is keyed (client, client).
    objects: HashMap<(u32, u32), RmObject>,
    /// UVM state.
    pub uvm: UvmState,
    /// Whether objects may be missing because the container's processes allocated them before tracing started.
    pub partial: bool,
    /// Bytes of live video memory (kept as objects come and go). Sizes come from params the process wrote,
    /// so the sum is kept wide enough never to overflow and reported saturated.
    vram: u128,
    /// The highest `vram` seen.
    peak_vram: u128,
}

/// Video-memory bytes an object holds.
fn vram_of(o: &RmObject) -> u128 {
    if class::is_video_memory(o.class) {
        u128::from(o.bytes)
    } else {
        0
    }
}

/// A wide byte total as a u64, saturated.
fn saturate(bytes: u128) -> u64 {
    u64::try_from(bytes).unwrap_or(u64::MAX)
}

impl ContainerLedger {
    /// Applies one decoded call made by `pid`. Calls the driver refused change nothing.
    pub fn apply(&mut self, pid: u32, op: &Op, rm_status: Option<u32>) {
        if rm_status.is_some_and(|s| s != status::NV_OK) {
            return;
        }
        match *op {
            Op::Alloc {
                client,
                parent,
                object,
                class,
                size,
            } => {
                if class::is_root(class) {
                    // A new client: the driver returns its handle in hObjectNew and files it as
                    // NV01_ROOT_CLIENT whichever root class was asked for.
                    self.insert(object, object, class::NV01_ROOT_CLIENT, object, 0, pid);
                } else {
                    self.insert(client, object, class, parent, size.unwrap_or(0), pid);
                }
            }
            Op::AllocMemory {
                client,
                parent,
                object,
                class,
                size,
            } => self.insert(client, object, class, parent, size, pid),
            Op::VidHeapAlloc {
                client,
                parent,
                object,
                size,
            } => self.insert(
                client,
                object,
                class::NV01_MEMORY_LOCAL_USER,
                parent,
                size,
                pid,
            ),
            Op::Free { client, object, .. } | Op::VidHeapFree { client, object, .. } => {
                self.free(client, object)
            }
            Op::UvmInitialize => self.uvm.initialized += 1,
            Op::UvmDeinitialize => self.uvm.initialized = self.uvm.initialized.saturating_sub(1),
            Op::UvmMmInitialize => self.uvm.mm_initialized += 1,
            Op::UvmRegisterGpu => self.uvm.gpus_registered += 1,
            Op::UvmUnregisterGpu => self.uvm.gpus_registered -= 1,
            Op::UvmRegisterVaSpace => self.uvm.va_spaces_registered += 1,
            _ => {}
        }
    }

    fn insert(
        &mut self,
        client: u32,
        handle: u32,
        class: u32,
        parent: u32,
        bytes: u64,
        owner: u32,
    ) {
        let obj = RmObject {
            class,
            parent,
            bytes,
            owner,
        };
        if let Some(old) = self.objects.insert((client, handle), obj) {
            self.vram -= vram_of(&old);
        }
        self.vram += vram_of(&obj);
        self.peak_vram = self.peak_vram.max(self.vram);
    }

    /// Removes the objects `doomed` selects, keeping the video-memory total right.
    fn remove_where(&mut self, mut doomed: impl FnMut(&(u32, u32), &RmObject) -> bool) {
        let mut freed = 0;
        self.objects.retain(|k, o| {
            let gone = doomed(k, o);
            if gone {
                freed += vram_of(o);
            }
            !gone
        });
        self.vram -= freed;
    }

    /// Frees `object` of `client` and its subtree; freeing the client frees everything under it.
    pub fn free(&mut self, client: u32, object: u32) {
        if object == client {
            self.remove_where(|(c, _), _| *c == client);
            return;
        }
        let mut doomed = vec![object];
        while let Some(h) = doomed.pop() {
            if let Some(o) = self.objects.remove(&(client, h)) {
                self.vram -= vram_of(&o);
                doomed.extend(
                    self.objects
                        .iter()
                        .filter(|((c, _), o)| *c == client && o.parent == h)
                        .map(|((_, k), _)| *k),
                );
            }
        }
    }

    /// The driver released every file of `pid`: its objects are gone, and so is its UVM state.
    pub fn release_process(&mut self, pid: u32) {
        self.remove_where(|_, o| o.owner == pid);
        if self.objects.is_empty() {
            self.uvm = UvmState::default();
        }
    }

    /// Live objects by class.
    pub fn live_by_class(&self) -> BTreeMap<u32, usize> {
        let mut m = BTreeMap::new();
        for o in self.objects.values() {
            *m.entry(o.class).or_insert(0) += 1;
        }
        m
    }

    /// Number of live objects.
    pub fn live_objects(&self) -> usize {
        self.objects.len()
    }

    /// Bytes held by live video-memory objects.
    pub fn vram_bytes(&self) -> u64 {
        saturate(self.vram)
    }

    /// The most video memory the container held at once while traced.
    pub fn peak_vram_bytes(&self) -> u64 {
        saturate(self.peak_vram)
    }

    /// Bytes held by all live memory objects (video and system memory).
    pub fn memory_bytes(&self) -> u64 {
        self.objects
            .values()
            .filter(|o| class::is_memory(o.class))
            .map(|o| o.bytes)
            .fold(0u64, u64::saturating_add)
    }

    /// Whether any RM object is live: the GPU still holds this container's state.
    pub fn holds_gpu_objects(&self) -> bool {
        !self.objects.is_empty()
    }

    /// The live object `(client, handle)`.
    pub fn object(&self, client: u32, handle: u32) -> Option<&RmObject> {
        self.objects.get(&(client, handle))
    }
}

/// Ledgers of every container seen, by cgroup v2 id.
#[derive(Debug, Default)]
pub struct Ledger {
    containers: HashMap<u64, ContainerLedger>,
}

impl Ledger {
    /// The ledger of `cgroup_id`, created on first use.
    pub fn container_mut(&mut self, cgroup_id: u64) -> &mut ContainerLedger {
        self.containers.entry(cgroup_id).or_default()
    }

    /// The ledger of `cgroup_id`, if the container was seen.
    pub fn container(&self, cgroup_id: u64) -> Option<&ContainerLedger> {
        self.containers.get(&cgroup_id)
    }

    /// Every container seen.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &ContainerLedger)> {
        self.containers.iter().map(|(k, v)| (*k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_nvidia::class::*;

    fn alloc(
        l: &mut ContainerLedger,
        client: u32,
        parent: u32,
        object: u32,
        class: u32,
        size: Option<u64>,
    ) {
        l.apply(
            1,
            &Op::Alloc {
                client,
                parent,
                object,
                class,
                size,
            },
            Some(status::NV_OK),
        );
    }

    #[test]
    fn freeing_a_client_frees_its_tree_and_subtrees_go_with_their_parent() {
        let mut l = ContainerLedger::default();
        alloc(&mut l, 0, 0, 0xc1, NV01_ROOT, None);
        assert_eq!(l.live_by_class().get(&NV01_ROOT_CLIENT), Some(&1));
        alloc(&mut l, 0xc1, 0xc1, 0xd0, NV01_DEVICE_0, None);
        alloc(&mut l, 0xc1, 0xd0, 0xd1, NV20_SUBDEVICE_0, None);
        alloc(
            &mut l,
            0xc1,
            0xd0,
            0xe0,
            NV01_MEMORY_LOCAL_USER,
            Some(1 << 20),
        );
        assert_eq!(l.live_objects(), 4);
        assert_eq!(l.vram_bytes(), 1 << 20);
        l.free(0xc1, 0xd0);
        assert_eq!(
            (l.vram_bytes(), l.peak_vram_bytes()),
            (0, 1 << 20),
            "memory freed with its device"
        );
        assert_eq!(l.live_objects(), 1, "device subtree freed, client left");
        alloc(&mut l, 0xc1, 0xc1, 0xd0, NV01_DEVICE_0, None);
        l.apply(
            1,
            &Op::Free {
                client: 0xc1,
                parent: 0,
                object: 0xc1,
            },
            Some(status::NV_OK),
        );
        assert!(!l.holds_gpu_objects());
    }

    /// Sizes come from params a process wrote: two huge ones must not overflow the totals.
    #[test]
    fn huge_sizes_saturate_instead_of_overflowing() {
        let mut l = ContainerLedger::default();
        let half = u64::MAX / 2 + 1;
        alloc(&mut l, 0, 0, 1, NV01_ROOT, None);
        alloc(&mut l, 1, 1, 2, NV01_MEMORY_LOCAL_USER, Some(half));
        alloc(&mut l, 1, 1, 3, NV01_MEMORY_LOCAL_USER, Some(half));
        assert_eq!(l.vram_bytes(), u64::MAX);
        assert_eq!(l.memory_bytes(), u64::MAX);
        l.free(1, 2);
        l.free(1, 1);
        assert_eq!(l.live_objects(), 0);
        assert_eq!(l.vram_bytes(), 0, "no underflow on the way down either");
    }

    #[test]
    fn refused_calls_change_nothing_and_process_release_drops_its_objects() {
        let mut l = ContainerLedger::default();
        l.apply(
            1,
            &Op::Alloc {
                client: 1,
                parent: 1,
                object: 2,
                class: NV01_DEVICE_0,
                size: None,
            },
            Some(0x22),
        );
        assert_eq!(l.live_objects(), 0);
        alloc(&mut l, 0, 0, 1, NV01_ROOT_CLIENT, None);
        l.apply(
            2,
            &Op::Alloc {
                client: 5,
                parent: 0,
                object: 5,
                class: NV01_ROOT_CLIENT,
                size: None,
            },
            Some(0),
        );
        l.release_process(1);
        assert_eq!(l.live_objects(), 1);
        assert!(l.object(5, 5).is_some());
    }
}
