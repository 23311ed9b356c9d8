//! The per-container ledger of GPU driver state: live RM clients and objects by class, GPU memory allocated
//! through memory classes, and UVM state, kept from the decoded calls of the container's processes.
//!
//! Driver semantics it follows (nvidia-driver.md, and the H200 recordings under
//! /work/shared/gpu/580.159.04/): a successful RM_FREE frees the object and its subtree, and freeing a client
//! frees the client's whole tree; a client lives on the open file it was allocated through, and the file's
//! final release frees every client still on it ([`ContainerLedger::release_file`]). A container holds GPU
//! state while one of its live objects is of a class that is more than a handle
//! (`baton_nvidia::class::is_handle_only`): memory, an address space, a channel, a context.
//!
//! A tenant can make its ledger look bigger, never smaller: what a call may change is judged from the
//! kernel's return and from both readings of its params ([`readings`]); an allocation whose handle is live
//! already is kept beside the live object, never in its place.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use baton_nvidia::class;

use crate::files::FileId;

pub mod readings;

pub use readings::{Readings, Verdict};

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
    /// Counted though its call read as refused, its readings differed, or its handle was live already.
    pub doubtful: bool,
    /// Its handle is only what the exit's reading said the driver chose: an RM_FREE naming it does not free
    /// it (see [`readings`]); it goes with its parent, its client or its file.
    pub handle_from_exit: bool,
}

/// An RM client the ledger believes is live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Client {
    /// The open file it was allocated through, whose final release frees it; `None` when the records never
    /// showed its allocation (its process was followed only later): then it goes when its owner holds no
    /// NVIDIA file any more.
    pub file: Option<FileId>,
    /// The process that allocated it (or first used it).
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

/// Calls whose readings the ledger doubted, since the container was first seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Doubts {
    /// Allocations counted though their status read as refused, their entry and exit readings named
    /// different objects, or their handle was live already.
    pub allocations: u64,
    /// Frees read as done that were not applied: their entry and exit readings named different objects.
    pub frees_disputed: u64,
}

/// Objects are keyed (client, handle, n): n is 0 but for an allocation at a handle that was live already,
/// kept beside it (1, 2, ...) rather than in its place.
type ObjectKey = (u32, u32, u32);

/// GPU driver state of one container (cgroup).
#[derive(Clone, Debug, Default)]
pub struct ContainerLedger {
    /// Live objects by (client, handle, n); a client itself is keyed (client, client, 0).
    objects: HashMap<ObjectKey, RmObject>,
    /// Live clients by handle.
    clients: HashMap<u32, Client>,
    /// Live objects of classes that hold GPU state (not handles only).
    state_objects: usize,
    /// UVM state.
    pub uvm: UvmState,
    /// Whether objects may be missing because the container's processes allocated them before tracing started.
    pub partial: bool,
    /// Bytes of live video memory (kept as objects come and go). Sizes come from params the process wrote,
    /// so the sum is kept wide enough never to overflow and reported saturated.
    vram: u128,
    /// The highest `vram` seen.
    peak_vram: u128,
    /// Calls whose readings it doubted.
    pub doubts: Doubts,
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
    /// Applies one call made by `pid` through open file `file` (`None`: a file the mirror does not know)
    /// that returned 0 from the kernel, as [`readings::judge`] lets it. Returns the verdict.
    pub fn apply(&mut self, pid: u32, file: Option<FileId>, r: &Readings) -> Verdict {
        let v = readings::judge(r);
        if v.doubtful {
            self.doubts.allocations += 1;
        }
        if v.free_disputed {
            self.doubts.frees_disputed += 1;
        }
        for a in &v.allocated {
            let obj = RmObject {
                class: a.class,
                parent: a.parent,
                bytes: a.bytes,
                owner: pid,
                doubtful: v.doubtful,
                handle_from_exit: a.handle_from_exit,
            };
            if a.class == class::NV01_ROOT_CLIENT && a.client == a.object {
                self.add_client(a.object, file, obj);
            } else {
                self.insert(a.client, a.object, obj);
            }
        }
        if let Some((client, object)) = v.freed {
            self.free_named(client, object, file);
        }
        if let Some((count, delta)) = v.uvm {
            self.count_uvm(count, delta > 0);
        }
        v
    }

    /// One UVM count up or down.
    fn count_uvm(&mut self, count: readings::UvmCount, up: bool) {
        use readings::UvmCount;
        let u = &mut self.uvm;
        match count {
            UvmCount::Initialized if up => u.initialized += 1,
            UvmCount::Initialized => u.initialized = u.initialized.saturating_sub(1),
            UvmCount::MmInitialized => u.mm_initialized += 1,
            UvmCount::GpusRegistered => u.gpus_registered += if up { 1 } else { -1 },
            UvmCount::VaSpacesRegistered => u.va_spaces_registered += 1,
        }
    }

    /// A new client, `obj` its root object: the driver returns its handle in hObjectNew and files it as
    /// NV01_ROOT_CLIENT whichever root class was asked for. It lives on the file it came through. A client
    /// the ledger has live already (a refused allocation whose params were rewritten to name it, or a free
    /// the ledger did not believe) keeps its file, owner and tree: a new reading never hides what was counted.
    fn add_client(&mut self, handle: u32, file: Option<FileId>, obj: RmObject) {
        if self.clients.contains_key(&handle) {
            if !obj.doubtful {
                self.doubts.allocations += 1;
            }
            return;
        }
        self.clients.insert(
            handle,
            Client {
                file,
                owner: obj.owner,
            },
        );
        self.insert(handle, handle, obj);
    }

    /// Counts object `obj` at `handle` of `client`. The driver refuses a handle that is live: one the ledger
    /// has live already is kept, and the new one counted beside it.
    fn insert(&mut self, client: u32, handle: u32, mut obj: RmObject) {
        // An object of a client whose allocation the records never showed: the client is known from now on,
        // on no known file.
        self.clients.entry(client).or_insert(Client {
            file: None,
            owner: obj.owner,
        });
        let mut n = 0;
        while self.objects.contains_key(&(client, handle, n)) {
            n += 1;
        }
        if n > 0 {
            if !obj.doubtful {
                self.doubts.allocations += 1;
            }
            obj.doubtful = true;
        }
        self.objects.insert((client, handle, n), obj);
        self.vram += vram_of(&obj);
        if !class::is_handle_only(obj.class) {
            self.state_objects += 1;
        }
        self.peak_vram = self.peak_vram.max(self.vram);
    }

    /// Takes object `o`, just removed from `objects`, off the totals.
    fn forget(&mut self, o: &RmObject) {
        self.vram -= vram_of(o);
        if !class::is_handle_only(o.class) {
            self.state_objects -= 1;
        }
    }

    /// Removes the objects `doomed` selects and returns them, keeping the totals right.
    fn take_where(
        &mut self,
        mut doomed: impl FnMut(&ObjectKey, &RmObject) -> bool,
    ) -> Vec<RmObject> {
        let mut gone = Vec::new();
        self.objects.retain(|k, o| {
            let g = doomed(k, o);
            if g {
                gone.push(*o);
            }
            !g
        });
        for o in &gone {
            self.forget(o);
        }
        gone
    }

    /// Removes the objects `doomed` selects, keeping the totals right. Returns how many held GPU state.
    fn remove_where(&mut self, doomed: impl FnMut(&ObjectKey, &RmObject) -> bool) -> usize {
        self.take_where(doomed)
            .iter()
            .filter(|o| !class::is_handle_only(o.class))
            .count()
    }

    /// An RM_FREE of `object` of `client` through `file`, read as done by both readings: applied unless the
    /// client lives on another file (the driver refuses a client of another file) or the object's handle
    /// came from an exit's reading alone (a root client is freed by its own handle: its objects' handles were
    /// read at their entry). A free refused for the file is counted as disputed; one of an exit-read handle
    /// is left to the object's parent, client or file (an honest caller that let the driver choose the
    /// handle frees it too, so it is no dispute).
    fn free_named(&mut self, client: u32, object: u32, file: Option<FileId>) {
        let elsewhere = self
            .clients
            .get(&client)
            .and_then(|c| c.file)
            .is_some_and(|on| file != Some(on));
        let unverified = object != client
            && self
                .objects
                .iter()
                .any(|((c, h, _), o)| *c == client && *h == object && o.handle_from_exit);
        if elsewhere {
            self.doubts.frees_disputed += 1;
            return;
        }
        if !unverified {
            self.free(client, object);
        }
    }

    /// Frees `object` of `client` and its subtree; freeing the client frees everything under it.
    pub fn free(&mut self, client: u32, object: u32) {
        if object == client {
            let _ = self.free_clients(&[client]);
            return;
        }
        // Every object the ledger keeps at a handle goes with it (the driver had one there).
        let mut doomed = vec![object];
        while let Some(h) = doomed.pop() {
            let gone = self.take_where(|(c, k, _), _| *c == client && *k == h);
            if !gone.is_empty() {
                doomed.extend(
                    self.objects
                        .iter()
                        .filter(|((c, _, _), o)| *c == client && o.parent == h)
                        .map(|((_, k, _), _)| *k),
                );
            }
        }
    }

    /// Frees `clients` and everything under them. Returns how many of the objects freed held GPU state.
    fn free_clients(&mut self, clients: &[u32]) -> usize {
        if clients.is_empty() {
            return 0;
        }
        for c in clients {
            self.clients.remove(c);
        }
        self.remove_where(|(c, _, _), _| clients.contains(c))
    }

    /// After a release: with no object left, the container's UVM state went with its files.
    fn reset_uvm_if_empty(&mut self) {
        if self.objects.is_empty() {
            self.uvm = UvmState::default();
        }
    }

    /// The driver released open file `file` (its last fd and mapping went): every client still on it is
    /// freed. Returns how many of the objects freed held GPU state.
    pub fn release_file(&mut self, file: FileId) -> usize {
        let doomed: Vec<u32> = self
            .clients
            .iter()
            .filter(|(_, c)| c.file == Some(file))
            .map(|(h, _)| *h)
            .collect();
        let freed = self.free_clients(&doomed);
        self.reset_uvm_if_empty();
        freed
    }

    /// Process `pid` holds no NVIDIA file any more: the clients it allocated on files the records never
    /// showed (it was followed only later) are gone with their files.
    pub fn release_process(&mut self, pid: u32) {
        let doomed: Vec<u32> = self
            .clients
            .iter()
            .filter(|(_, c)| c.file.is_none() && c.owner == pid)
            .map(|(h, _)| *h)
            .collect();
        let _ = self.free_clients(&doomed);
        self.reset_uvm_if_empty();
    }

    /// The processes that allocated the clients holding GPU state now (a forked child that only inherited
    /// the files owns none).
    pub fn state_owners(&self) -> BTreeSet<u32> {
        self.objects
            .iter()
            .filter(|(_, o)| !class::is_handle_only(o.class))
            .filter_map(|((c, _, _), _)| self.clients.get(c).map(|cl| cl.owner))
            .collect()
    }

    /// Live clients by handle.
    pub fn clients(&self) -> impl Iterator<Item = (u32, &Client)> {
        self.clients.iter().map(|(h, c)| (*h, c))
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

    /// Live objects of classes that hold GPU state (memory, address spaces, channels, contexts: not handles).
    pub fn state_objects(&self) -> usize {
        self.state_objects
    }

    /// Whether the GPU still holds this container's state: a live object that is more than a handle.
    pub fn holds_gpu_state(&self) -> bool {
        self.state_objects > 0
    }

    /// The live object `(client, handle)` (the first counted there).
    pub fn object(&self, client: u32, handle: u32) -> Option<&RmObject> {
        self.objects.get(&(client, handle, 0))
    }

    /// Live objects counted though their readings were doubtful.
    pub fn doubtful_objects(&self) -> usize {
        self.objects.values().filter(|o| o.doubtful).count()
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

    /// Open file `file` was released: the clients on it are freed, in whichever ledger they are. Returns
    /// how many of the objects freed held GPU state.
    pub fn release_file(&mut self, file: FileId) -> usize {
        self.containers
            .values_mut()
            .map(|l| l.release_file(file))
            .sum()
    }

    /// Every container seen.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &ContainerLedger)> {
        self.containers.iter().map(|(k, v)| (*k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_nvidia::{class::*, decode::Op, status};

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
            None,
            &Readings::agreeing(
                &Op::Alloc {
                    client,
                    parent,
                    object,
                    class,
                    size,
                },
                Some(status::NV_OK),
            ),
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
            None,
            &Readings::agreeing(
                &Op::Free {
                    client: 0xc1,
                    parent: 0,
                    object: 0xc1,
                },
                Some(status::NV_OK),
            ),
        );
        assert!(!l.holds_gpu_state());
        assert_eq!(l.live_objects(), 0);
    }

    /// A client holding only handles (a device, a subdevice: what NVML and CUDA's checkpoint queries make)
    /// holds no GPU state; one with memory or an address space does.
    #[test]
    fn only_objects_that_are_more_than_handles_hold_gpu_state() {
        let mut l = ContainerLedger::default();
        alloc(&mut l, 0, 0, 0xc1, NV01_ROOT_CLIENT, None);
        alloc(&mut l, 0xc1, 0xc1, 0xd0, NV01_DEVICE_0, None);
        alloc(&mut l, 0xc1, 0xd0, 0xd1, NV20_SUBDEVICE_0, None);
        assert!(!l.holds_gpu_state());
        alloc(&mut l, 0xc1, 0xd0, 0xd2, FERMI_VASPACE_A, None);
        assert!(l.holds_gpu_state());
        assert_eq!(l.state_owners(), [1].into());
        l.free(0xc1, 0xd2);
        assert!(!l.holds_gpu_state());
        assert_eq!(l.state_objects(), 0);
    }

    /// A client lives on the file it was allocated through: that file's release frees it, another's not.
    #[test]
    fn a_files_release_frees_the_clients_on_it() {
        let mut l = ContainerLedger::default();
        let (f1, f2) = (FileId(1), FileId(2));
        for (client, file) in [(0xc1, f1), (0xc2, f2)] {
            l.apply(
                7,
                Some(file),
                &Readings::agreeing(
                    &Op::Alloc {
                        client: 0,
                        parent: 0,
                        object: client,
                        class: NV01_ROOT_CLIENT,
                        size: None,
                    },
                    Some(status::NV_OK),
                ),
            );
            alloc(
                &mut l,
                client,
                client,
                client + 0x100,
                NV01_MEMORY_LOCAL_USER,
                Some(4096),
            );
        }
        assert_eq!(l.release_file(f1), 1, "its memory held state");
        assert_eq!(l.vram_bytes(), 4096);
        assert!(l.object(0xc2, 0xc2).is_some());
        l.release_process(7);
        assert!(
            l.holds_gpu_state(),
            "a client on a known file goes with the file, not the process"
        );
        assert_eq!(l.release_file(f2), 1);
        assert_eq!(l.release_file(f2), 0, "nothing left on it");
        assert!(!l.holds_gpu_state());
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

    /// The driver's RM errors return 0 from the kernel too, and the status lives in memory the caller can
    /// rewrite: an allocation read as refused is counted, doubtful, and goes with its client like any other.
    #[test]
    fn an_allocation_read_as_refused_is_counted_doubtful_and_goes_with_its_process() {
        let mut l = ContainerLedger::default();
        alloc(&mut l, 0, 0, 1, NV01_ROOT_CLIENT, None);
        let refused = Op::Alloc {
            client: 1,
            parent: 1,
            object: 2,
            class: NV01_MEMORY_LOCAL_USER,
            size: Some(1 << 20),
        };
        l.apply(1, None, &Readings::agreeing(&refused, Some(0x22)));
        assert_eq!((l.live_objects(), l.vram_bytes()), (2, 1 << 20));
        assert_eq!((l.doubtful_objects(), l.doubts.allocations), (1, 1));
        let other = Op::Alloc {
            client: 5,
            parent: 0,
            object: 5,
            class: NV01_ROOT_CLIENT,
            size: None,
        };
        l.apply(2, None, &Readings::agreeing(&other, Some(0)));
        l.release_process(1);
        assert_eq!(l.live_objects(), 1);
        assert!(l.object(5, 5).is_some());
        assert_eq!(l.doubts.allocations, 1, "the count stays");
    }

    /// An allocation whose handle is live already (the driver would have refused it: its status was
    /// rewritten) is counted beside the live object, which it never replaces; a free of the handle frees both.
    #[test]
    fn an_allocation_at_a_live_handle_never_replaces_what_was_counted_there() {
        let mut l = ContainerLedger::default();
        alloc(&mut l, 0, 0, 1, NV01_ROOT_CLIENT, None);
        alloc(&mut l, 1, 1, 2, NV01_MEMORY_LOCAL_USER, Some(1 << 30));
        alloc(&mut l, 1, 1, 2, NV01_MEMORY_LOCAL_USER, Some(4096));
        assert_eq!(l.vram_bytes(), (1 << 30) + 4096);
        assert_eq!(l.object(1, 2).map(|o| o.bytes), Some(1 << 30));
        assert_eq!((l.doubtful_objects(), l.doubts.allocations), (1, 1));
        // A root client read again at a live client's handle keeps the client, its file and its tree.
        let again = Op::Alloc {
            client: 0,
            parent: 0,
            object: 1,
            class: NV01_ROOT_CLIENT,
            size: None,
        };
        l.apply(9, Some(FileId(7)), &Readings::agreeing(&again, Some(0)));
        assert_eq!(l.vram_bytes(), (1 << 30) + 4096);
        assert_eq!(
            l.release_file(FileId(7)),
            0,
            "the client is not on that file"
        );
        l.free(1, 2);
        assert_eq!((l.vram_bytes(), l.live_objects()), (0, 1));
    }

    /// An object whose handle the driver chose (asked for as 0) is freed with its client, never by an RM_FREE
    /// of the handle the exit read (which the caller may have rewritten); a free through another file than
    /// its client's frees nothing.
    #[test]
    fn exit_read_handles_go_with_their_client_and_a_free_must_come_through_the_clients_file() {
        let mut l = ContainerLedger::default();
        let root = Op::Alloc {
            client: 0,
            parent: 0,
            object: 1,
            class: NV01_ROOT_CLIENT,
            size: None,
        };
        l.apply(1, Some(FileId(3)), &Readings::agreeing(&root, Some(0)));
        let (asked, got) = (
            Op::Alloc {
                client: 1,
                parent: 1,
                object: 0,
                class: NV01_MEMORY_LOCAL_USER,
                size: Some(1 << 20),
            },
            Op::Alloc {
                client: 1,
                parent: 1,
                object: 0x99,
                class: NV01_MEMORY_LOCAL_USER,
                size: Some(1 << 20),
            },
        );
        let chosen = Readings {
            exit: &got,
            status: Some(status::NV_OK),
            enter: Some(&asked),
        };
        l.apply(1, Some(FileId(3)), &chosen);
        alloc(&mut l, 1, 1, 2, NV01_MEMORY_LOCAL_USER, Some(4096));
        let free = |object| Op::Free {
            client: 1,
            parent: 1,
            object,
        };
        l.apply(
            1,
            Some(FileId(3)),
            &Readings::agreeing(&free(0x99), Some(0)),
        );
        assert_eq!(
            l.vram_bytes(),
            (1 << 20) + 4096,
            "not by its exit-read handle"
        );
        l.apply(1, Some(FileId(4)), &Readings::agreeing(&free(2), Some(0)));
        assert_eq!(l.doubts.frees_disputed, 1, "another file");
        assert_eq!(l.vram_bytes(), (1 << 20) + 4096);
        l.apply(1, Some(FileId(3)), &Readings::agreeing(&free(2), Some(0)));
        assert_eq!(l.vram_bytes(), 1 << 20);
        l.apply(1, Some(FileId(3)), &Readings::agreeing(&free(1), Some(0)));
        assert_eq!(
            (l.vram_bytes(), l.live_objects()),
            (0, 0),
            "with its client"
        );
    }

    /// A free whose entry reading named another object (a refused RM_FREE rewritten after the driver's
    /// copy-out to name a live handle and NV_OK) frees nothing, and is counted.
    #[test]
    fn a_free_whose_readings_disagree_frees_nothing() {
        let mut l = ContainerLedger::default();
        alloc(&mut l, 0, 0, 1, NV01_ROOT_CLIENT, None);
        alloc(&mut l, 1, 1, 2, NV01_MEMORY_LOCAL_USER, Some(1 << 20));
        let (asked, read) = (
            Op::Free {
                client: 1,
                parent: 1,
                object: 0xdead,
            },
            Op::Free {
                client: 1,
                parent: 1,
                object: 2,
            },
        );
        let forged = Readings {
            exit: &read,
            status: Some(status::NV_OK),
            enter: Some(&asked),
        };
        l.apply(1, None, &forged);
        assert_eq!(l.vram_bytes(), 1 << 20);
        assert_eq!(l.doubts.frees_disputed, 1);
        l.apply(1, None, &Readings::agreeing(&read, Some(status::NV_OK)));
        assert_eq!(l.vram_bytes(), 0);
    }
}
