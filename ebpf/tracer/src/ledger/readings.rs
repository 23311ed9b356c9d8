//! What one RM call may change in the ledger, judged from what the kernel and the driver guarantee rather
//! than from what the caller can write.
//!
//! The RM status, the handles and the sizes live in the caller's memory: the probes read them at the
//! syscall's exit, after the driver's copy-out, and once more, for the calls that allocate or free, at its
//! entry, before the driver's copy-in (`baton_probe_common::EnterReading`). Another thread of the caller can
//! rewrite the params between the copy-out and the exit's read, so neither reading is the driver's word;
//! only the syscall's return value is the kernel's. Hence:
//! - an allocation the kernel returned 0 for is counted whatever status was read (the driver's RM errors
//!   return 0 too, so a real refusal is counted as well: it goes with its client or file), under each
//!   handle its readings name and at the larger size; one read as refused, or whose readings differ, is
//!   *doubtful*. A handle the driver chooses (a root client's; any object's asked for as 0) is only in the
//!   exit's reading: the object is counted there, and an RM_FREE naming that handle does not free it (the
//!   caller could have rewritten it to a handle the driver never gave, then forged that handle's free); it
//!   goes with its parent, its client or its file;
//! - a free is applied only when the status reads NV_OK, the entry's reading names the same object as the
//!   exit's (a refused RM_FREE rewritten afterwards to name a live handle frees nothing), and the client
//!   lives on the file the call came through (the driver refuses a client of another file);
//! - UVM counts go up whatever the status, and down only on NV_OK.
//!
//! What can still fool it: a thread that rewrites the params between the entry's read and the driver's
//! copy-in *and* again between the copy-out and the exit's read shows both readings a call the driver never
//! saw (a free of a live handle the driver refused; an allocation at a handle or size other than the one
//! the driver made). Where NVML is present the gate's floor (`tools/agent/src/gate/floor.rs`) bounds what
//! that can hide.
use baton_nvidia::{class, decode::Op, status};

/// The readings of one call that returned 0 from the kernel.
#[derive(Clone, Copy, Debug)]
pub struct Readings<'a> {
    /// The operation as the params read at the syscall's exit.
    pub exit: &'a Op,
    /// The RM status read at the exit.
    pub status: Option<u32>,
    /// The operation as the params read at its entry (`None`: not read, or an escape that is not read there).
    pub enter: Option<&'a Op>,
}

impl<'a> Readings<'a> {
    /// `op` read the same at the entry and the exit, with `status`.
    pub fn agreeing(op: &'a Op, status: Option<u32>) -> Self {
        Self {
            exit: op,
            status,
            enter: Some(op),
        }
    }
}

/// An object a call allocated, as one reading names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocated {
    /// hRoot (for a root class: the new client, `object`).
    pub client: u32,
    /// hObjectParent.
    pub parent: u32,
    /// Its handle.
    pub object: u32,
    /// Its class (video memory for RM_VID_HEAP_CONTROL).
    pub class: u32,
    /// Bytes: the larger of the two readings' sizes.
    pub bytes: u64,
    /// Its handle was chosen by the driver (asked for as 0), so only the exit's reading names it.
    pub handle_from_exit: bool,
}

/// What the ledger takes from one call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// The objects to count (none, one, or one per reading when they name different ones).
    pub allocated: Vec<Allocated>,
    /// The object to free (the whole client when `object == client`).
    pub freed: Option<(u32, u32)>,
    /// An allocation counted though read as refused, or whose readings differ.
    pub doubtful: bool,
    /// A free read as done whose entry and exit readings name different objects (or whose entry was not
    /// read): not applied.
    pub free_disputed: bool,
    /// A UVM count to change (+1, -1) and which.
    pub uvm: Option<(UvmCount, i8)>,
}

/// The UVM counts a call changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UvmCount {
    /// UVM_INITIALIZE / UVM_DEINITIALIZE.
    Initialized,
    /// UVM_MM_INITIALIZE.
    MmInitialized,
    /// UVM_REGISTER_GPU / UVM_UNREGISTER_GPU.
    GpusRegistered,
    /// UVM_REGISTER_GPU_VASPACE.
    VaSpacesRegistered,
}

/// The object an allocating reading names, with its own size (`None` for other operations).
fn allocation(op: &Op) -> Option<(Allocated, bool)> {
    let (client, parent, object, class, bytes) = match *op {
        Op::Alloc {
            client,
            parent,
            object,
            class,
            size,
        } => (client, parent, object, class, size.unwrap_or(0)),
        Op::AllocMemory {
            client,
            parent,
            object,
            class,
            size,
        } => (client, parent, object, class, size),
        Op::VidHeapAlloc {
            client,
            parent,
            object,
            size,
        } => (client, parent, object, class::NV01_MEMORY_LOCAL_USER, size),
        _ => return None,
    };
    let root = matches!(op, Op::Alloc { .. }) && class::is_root(class);
    let a = Allocated {
        client: if root { object } else { client },
        parent: if root { object } else { parent },
        object,
        class: if root { class::NV01_ROOT_CLIENT } else { class },
        bytes,
        handle_from_exit: root,
    };
    Some((a, root))
}

/// The object a freeing reading names.
fn freeing(op: &Op) -> Option<(u32, u32, u32)> {
    match *op {
        Op::Free {
            client,
            parent,
            object,
        }
        | Op::VidHeapFree {
            client,
            parent,
            object,
        } => Some((client, parent, object)),
        _ => None,
    }
}

/// The UVM count `op` changes, if any.
fn uvm(op: &Op) -> Option<(UvmCount, i8)> {
    Some(match op {
        Op::UvmInitialize => (UvmCount::Initialized, 1),
        Op::UvmDeinitialize => (UvmCount::Initialized, -1),
        Op::UvmMmInitialize => (UvmCount::MmInitialized, 1),
        Op::UvmRegisterGpu => (UvmCount::GpusRegistered, 1),
        Op::UvmUnregisterGpu => (UvmCount::GpusRegistered, -1),
        Op::UvmRegisterVaSpace => (UvmCount::VaSpacesRegistered, 1),
        _ => return None,
    })
}

/// Whether the entry's and the exit's allocating readings name the same object (sizes aside; a root client's
/// handle, and a handle asked for as 0, are the driver's to choose: only the exit's reading has them).
fn same_object(exit: &(Allocated, bool), enter: &(Allocated, bool)) -> bool {
    let ((x, x_root), (e, e_root)) = (exit, enter);
    if *x_root || *e_root {
        return x_root == e_root;
    }
    let handle = e.object == 0 || e.object == x.object;
    handle && (x.client, x.parent, x.class) == (e.client, e.parent, e.class)
}

/// What a call that returned 0 from the kernel changes, by the rules of the module's doc.
pub fn judge(r: &Readings) -> Verdict {
    let ok = r.status == Some(status::NV_OK);
    let mut v = Verdict::default();
    let exit = allocation(r.exit);
    let enter = r.enter.and_then(allocation);
    if exit.is_some() || enter.is_some() {
        let bytes = exit.iter().chain(&enter).map(|(a, _)| a.bytes).max();
        let bytes = bytes.unwrap_or(0);
        let agree = matches!((&exit, &enter), (Some(x), Some(e)) if same_object(x, e));
        v.doubtful = !ok || !agree;
        // The exit's reading first: a handle the driver chose is counted as it returned it there.
        let chosen = matches!(&enter, Some((e, _)) if e.object == 0);
        if let Some((a, _)) = exit {
            let handle_from_exit = a.handle_from_exit || chosen;
            v.allocated.push(Allocated {
                bytes,
                handle_from_exit,
                ..a
            });
        }
        // The entry's, when it names another object the driver could have made (asked for as handle 0: held
        // at 0, which no RM_FREE frees).
        if let Some((a, root)) = enter
            && !agree
            && !root
        {
            let handle_from_exit = a.object == 0;
            v.allocated.push(Allocated {
                bytes,
                handle_from_exit,
                ..a
            });
        }
    }
    if let Some(named) = freeing(r.exit) {
        let confirmed = r.enter.and_then(freeing) == Some(named);
        if ok && confirmed {
            v.freed = Some((named.0, named.2));
        } else if ok {
            v.free_disputed = true;
        }
    }
    v.uvm = uvm(r.exit).filter(|(_, delta)| *delta > 0 || ok);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_nvidia::class::*;

    const REFUSED: u32 = status::NV_ERR_INSUFFICIENT_RESOURCES;

    fn memory(object: u32, size: u64) -> Op {
        Op::Alloc {
            client: 0xc1,
            parent: 0xd0,
            object,
            class: NV01_MEMORY_LOCAL_USER,
            size: Some(size),
        }
    }

    fn free(object: u32) -> Op {
        Op::Free {
            client: 0xc1,
            parent: 0xd0,
            object,
        }
    }

    fn counted(v: &Verdict) -> Vec<(u32, u64)> {
        v.allocated.iter().map(|a| (a.object, a.bytes)).collect()
    }

    #[test]
    fn an_allocation_is_counted_whatever_status_was_read_and_one_read_as_refused_is_doubtful() {
        let op = memory(0xe0, 4096);
        let ok = judge(&Readings::agreeing(&op, Some(status::NV_OK)));
        assert_eq!((counted(&ok), ok.doubtful), (vec![(0xe0, 4096)], false));
        let refused = judge(&Readings::agreeing(&op, Some(REFUSED)));
        assert_eq!(
            (counted(&refused), refused.doubtful),
            (vec![(0xe0, 4096)], true)
        );
    }

    #[test]
    fn readings_that_differ_count_the_larger_size_under_each_handle() {
        let (enter, exit) = (memory(0xe0, 1 << 30), memory(0xe1, 0));
        let v = judge(&Readings {
            exit: &exit,
            status: Some(status::NV_OK),
            enter: Some(&enter),
        });
        assert_eq!(counted(&v), vec![(0xe1, 1 << 30), (0xe0, 1 << 30)]);
        assert!(v.doubtful);
        // Same handle, a size shrunk after the copy-out: one object at the size read at the entry.
        let shrunk = memory(0xe0, 4096);
        let v = judge(&Readings {
            exit: &shrunk,
            status: Some(status::NV_OK),
            enter: Some(&enter),
        });
        assert_eq!(counted(&v), vec![(0xe0, 1 << 30)]);
        // An exit reading that no longer allocates (its params unmapped, or rewritten into another call):
        // the entry's reading is counted.
        let v = judge(&Readings {
            exit: &Op::Truncated,
            status: None,
            enter: Some(&enter),
        });
        assert_eq!((counted(&v), v.doubtful), (vec![(0xe0, 1 << 30)], true));
    }

    #[test]
    fn a_root_client_counts_under_the_handle_the_driver_returned() {
        let asked = Op::Alloc {
            client: 0,
            parent: 0,
            object: 0,
            class: NV01_ROOT,
            size: None,
        };
        let got = Op::Alloc {
            client: 0,
            parent: 0,
            object: 0xc1d0_0001,
            class: NV01_ROOT,
            size: None,
        };
        let v = judge(&Readings {
            exit: &got,
            status: Some(status::NV_OK),
            enter: Some(&asked),
        });
        assert_eq!(counted(&v), vec![(0xc1d0_0001, 0)]);
        assert_eq!(v.allocated[0].class, NV01_ROOT_CLIENT);
        assert!(!v.doubtful);
    }

    #[test]
    fn a_handle_asked_for_as_0_is_counted_as_the_exit_read_it_and_marked_so() {
        let (asked, got) = (memory(0, 1 << 20), memory(0xe7, 1 << 20));
        let v = judge(&Readings {
            exit: &got,
            status: Some(status::NV_OK),
            enter: Some(&asked),
        });
        assert_eq!((counted(&v), v.doubtful), (vec![(0xe7, 1 << 20)], false));
        assert!(v.allocated[0].handle_from_exit);
        // Its exit unreadable: it is still counted, at handle 0.
        let v = judge(&Readings {
            exit: &Op::Truncated,
            status: None,
            enter: Some(&asked),
        });
        assert_eq!(counted(&v), vec![(0, 1 << 20)]);
        assert!(v.allocated[0].handle_from_exit && v.doubtful);
    }

    #[test]
    fn a_free_needs_nv_ok_and_both_readings_to_name_one_object() {
        let named = free(0xe0);
        let v = judge(&Readings::agreeing(&named, Some(status::NV_OK)));
        assert_eq!((v.freed, v.free_disputed), (Some((0xc1, 0xe0)), false));
        let v = judge(&Readings::agreeing(&named, Some(REFUSED)));
        assert_eq!((v.freed, v.free_disputed), (None, false), "refused");
        // A refused free of a handle that does not exist, rewritten after the copy-out to name a live one.
        let bogus = free(0xdead);
        let v = judge(&Readings {
            exit: &named,
            status: Some(status::NV_OK),
            enter: Some(&bogus),
        });
        assert_eq!((v.freed, v.free_disputed), (None, true));
        let v = judge(&Readings {
            exit: &named,
            status: Some(status::NV_OK),
            enter: None,
        });
        assert_eq!((v.freed, v.free_disputed), (None, true), "no entry reading");
        // An allocation at the entry rewritten into a free: the allocation counts, nothing is freed.
        let enter = memory(0xe5, 4096);
        let v = judge(&Readings {
            exit: &named,
            status: Some(status::NV_OK),
            enter: Some(&enter),
        });
        assert_eq!((counted(&v), v.freed), (vec![(0xe5, 4096)], None));
    }

    #[test]
    fn uvm_counts_go_up_whatever_the_status_and_down_only_on_nv_ok() {
        let up = judge(&Readings::agreeing(&Op::UvmRegisterGpu, Some(REFUSED)));
        assert_eq!(up.uvm, Some((UvmCount::GpusRegistered, 1)));
        let down = judge(&Readings::agreeing(&Op::UvmUnregisterGpu, Some(REFUSED)));
        assert_eq!(down.uvm, None);
        let down = judge(&Readings::agreeing(
            &Op::UvmUnregisterGpu,
            Some(status::NV_OK),
        ));
        assert_eq!(down.uvm, Some((UvmCount::GpusRegistered, -1)));
    }
}
