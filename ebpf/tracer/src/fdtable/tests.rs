//! The mirror against the kernel's rules for fds, open files and mapping ranges.
use super::*;

const PAGE: u64 = 4096;

fn released(t: &mut FdTable) -> Vec<FileId> {
    let mut ids: Vec<FileId> = t.take_released().into_iter().map(|(id, _)| id).collect();
    ids.sort();
    ids
}

#[test]
fn partial_unmap_trims_and_full_unmap_releases() {
    let mut t = FdTable::default();
    let f = t.open(7, 1, 3, FdKind::Device, 0);
    assert!(t.map_fd(7, 1, 3, 0x10000, 3 * PAGE));
    assert_eq!(t.remove_fd(7, 3).map(|nv| nv.file), Some(f));
    assert!(released(&mut t).is_empty(), "the mapping keeps the file");
    assert_eq!(t.unmap(7, 0x11000, PAGE), PAGE);
    assert_eq!(t.get(7).unwrap().maps.len(), 2, "a hole in the middle");
    assert!(released(&mut t).is_empty(), "the rest is still mapped");
    assert_eq!(t.unmap(7, 0, 0x100000), 2 * PAGE);
    assert!(
        t.get(7).is_none(),
        "a process with nothing left is forgotten"
    );
    assert_eq!(
        released(&mut t),
        vec![f],
        "the last range was the file's last reference"
    );
}

#[test]
fn a_length_is_rounded_up_to_whole_pages_as_the_kernel_does() {
    let mut t = FdTable::default();
    t.open(7, 1, 3, FdKind::Ctl, 255);
    t.map_fd(7, 1, 3, 0x10000, 100);
    assert_eq!(t.get(7).unwrap().maps[&0x10000].len, PAGE);
    assert_eq!(t.unmap(7, 0x10000, 1), PAGE);
}

#[test]
fn fork_shares_files_but_not_dontfork_ranges_and_exec_drops_closed_fds() {
    let mut t = FdTable::default();
    let ctl = t.open(1, 9, 3, FdKind::Ctl, 255);
    let dev = t.open(1, 9, 4, FdKind::Device, 0);
    t.map_fd(1, 9, 4, 0x100000, 2 * PAGE);
    t.map_fd(1, 9, 4, 0x200000, PAGE);
    t.set_dont_fork(1, 0x200000, PAGE, true);
    let copied = t.fork(1, 2);
    assert_eq!(copied.len(), 2);
    let child = t.get(2).unwrap();
    assert_eq!(
        child.fds[&3].file, ctl,
        "a forked child shares the open file"
    );
    assert_eq!(child.maps.len(), 1, "the MADV_DONTFORK range is not copied");
    assert_eq!(t.exec(2, &|fd| fd == 3), vec![4]);
    assert!(
        t.get(2).unwrap().maps.is_empty(),
        "no mapping survives exec"
    );
    assert!(t.exit(1).is_some());
    assert_eq!(
        released(&mut t),
        vec![dev],
        "the child still holds the ctl file"
    );
    assert_eq!(t.remove_fd(2, 3).map(|nv| nv.file), Some(ctl));
    assert!(t.get(2).is_none());
    assert_eq!(released(&mut t), vec![ctl]);
}

#[test]
fn dup_shares_the_file_and_close_range_forgets_only_its_range() {
    let mut t = FdTable::default();
    let f = t.open(1, 9, 3, FdKind::Ctl, 255);
    t.dup(1, 9, 7, 3, FdKind::Ctl, 255);
    t.dup(1, 9, 9, 3, FdKind::Ctl, 255);
    let mut closed = t.remove_range(1, 4, 9);
    closed.sort();
    assert_eq!(closed, vec![7, 9]);
    assert!(released(&mut t).is_empty());
    assert_eq!(t.remove_range(1, 0, u32::MAX), vec![3]);
    assert!(t.get(1).is_none());
    assert_eq!(released(&mut t), vec![f]);
}

#[test]
fn a_dup_is_the_file_the_mirror_has_under_the_old_number_whatever_kind_the_record_says() {
    // The record's kind came from the kernel map, which user space may have overwritten with an older
    // file's kind for a reused fd number; the mirror, applied in order, knows what the number was.
    let mut t = FdTable::default();
    let dev = t.open(1, 9, 10, FdKind::Device, 0);
    t.dup(1, 9, 11, 10, FdKind::Ctl, 255);
    let nv = t.get(1).unwrap().fds[&11];
    assert_eq!((nv.kind, nv.minor, nv.file), (FdKind::Device, 0, dev));
    t.dup(1, 9, 12, 5, FdKind::Ctl, 255);
    let unknown = t.get(1).unwrap().fds[&12];
    assert_eq!(
        unknown.kind,
        FdKind::Ctl,
        "a dup of a number the mirror never saw takes the record's kind"
    );
    assert_ne!(unknown.file, dev);
}

#[test]
fn a_registered_device_file_keeps_its_ctl_file() {
    let mut t = FdTable::default();
    let ctl = t.open(1, 9, 3, FdKind::Ctl, 255);
    let dev = t.open(1, 9, 4, FdKind::Device, 0);
    t.keep(dev, ctl);
    t.remove_fd(1, 3);
    assert!(released(&mut t).is_empty());
    t.remove_fd(1, 4);
    assert_eq!(released(&mut t), vec![ctl, dev]);
}

/// What the real driver's checkpoint does to each device mapping (recording:
/// /work/shared/gpu/580.159.04/maps-parked.txt): an anonymous MAP_FIXED over it ends it, as an munmap would;
/// over half of it, the other half stays.
#[test]
fn map_fixed_over_a_range_ends_what_it_covers() {
    let mut t = FdTable::default();
    let f = t.open(1, 9, 4, FdKind::Device, 0);
    t.map_fd(1, 9, 4, 0x100000, 4 * PAGE);
    t.remove_fd(1, 4);
    // MapFixed is applied as an unmap of its range.
    assert_eq!(t.unmap(1, 0x100000, 2 * PAGE), 2 * PAGE);
    assert_eq!(t.get(1).unwrap().maps[&0x102000].len, 2 * PAGE);
    assert!(
        released(&mut t).is_empty(),
        "half a mapping still holds the file"
    );
    assert_eq!(t.unmap(1, 0x102000, 2 * PAGE), 2 * PAGE);
    assert_eq!(released(&mut t), vec![f]);
}

#[test]
fn mremap_moves_shrinks_and_grows_ranges() {
    let mut t = FdTable::default();
    let f = t.open(1, 9, 4, FdKind::Device, 0);
    t.map_fd(1, 9, 4, 0x100000, 4 * PAGE);
    t.remove_fd(1, 4);
    // Moved (MREMAP_MAYMOVE): the file is still mapped, elsewhere.
    let gone = t.mremap(1, 9, (0x100000, 4 * PAGE), (0x900000, 4 * PAGE), 1);
    assert_eq!(gone, 0);
    assert!(
        released(&mut t).is_empty(),
        "a moved mapping still holds its file"
    );
    let maps: Vec<(u64, u64)> = t
        .get(1)
        .unwrap()
        .maps
        .iter()
        .map(|(a, m)| (*a, m.len))
        .collect();
    assert_eq!(maps, vec![(0x900000, 4 * PAGE)]);
    // Shrunk in place: the tail went.
    assert_eq!(
        t.mremap(1, 9, (0x900000, 4 * PAGE), (0x900000, PAGE), 0),
        3 * PAGE
    );
    // Grown in place.
    assert_eq!(t.mremap(1, 9, (0x900000, PAGE), (0x900000, 2 * PAGE), 0), 0);
    assert_eq!(t.get(1).unwrap().maps[&0x900000].len, 2 * PAGE);
    // A MREMAP_FIXED move of another mapping onto it replaces it.
    let other = t.open(1, 9, 5, FdKind::Ctl, 255);
    t.map_fd(1, 9, 5, 0x500000, 2 * PAGE);
    t.remove_fd(1, 5);
    let gone = t.mremap(1, 9, (0x500000, 2 * PAGE), (0x900000, 2 * PAGE), 1 | 2);
    assert_eq!(gone, 2 * PAGE);
    assert_eq!(released(&mut t), vec![f]);
    assert_eq!(t.get(1).unwrap().maps[&0x900000].file, other);
}

#[test]
fn reconcile_drops_what_proc_does_not_show_and_follows_what_it_shows_as_opaque() {
    let mut t = FdTable::default();
    let ctl = t.open(1, 9, 3, FdKind::Ctl, 255);
    let dev = t.open(1, 9, 4, FdKind::Device, 0);
    t.map_fd(1, 9, 4, 0x100000, PAGE);
    let seen = [
        Seen::Fd {
            fd: 3,
            kind: FdKind::Ctl,
            minor: 255,
        },
        Seen::Fd {
            fd: 8,
            kind: FdKind::Device,
            minor: 0,
        },
    ];
    let c = t.reconcile(1, 9, true, &seen);
    assert_eq!(c.stale_fds, vec![4]);
    assert_eq!(c.stale_maps, vec![0x100000]);
    assert_eq!(c.new_fds, vec![8]);
    assert_eq!(released(&mut t), vec![dev]);
    let p = t.get(1).unwrap();
    assert_eq!(p.fds[&3].file, ctl, "what both show keeps its identity");
    let opaque = p.fds[&8].file;
    assert!(t.files().get(opaque).unwrap().opaque);
    let c = t.reconcile(1, 9, false, &[]);
    assert_eq!(c.stale_fds.len(), 2);
    assert_eq!(released(&mut t), vec![ctl, opaque]);
}
