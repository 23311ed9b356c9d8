//! The freezer on tempdir fixtures: where it looks (mountinfo, /proc/PID/cgroup), what it writes and reads, and
//! that it waits on re-reads when no notification comes (a fixture's regular files never notify).
use std::{fs, path::Path, time::Duration};

use procfs::ProcessCGroup;

use super::*;

const HYBRID: &str = "\
30 24 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
35 30 0:31 / /sys/fs/cgroup/freezer rw,nosuid - cgroup cgroup rw,freezer
36 30 0:32 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
37 30 0:33 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
";

fn cg(hierarchy: u32, controllers: &[&str], path: &str) -> ProcessCGroup {
    ProcessCGroup {
        hierarchy,
        controllers: controllers.iter().map(|c| c.to_string()).collect(),
        pathname: path.into(),
    }
}

fn cgroup_dir(root: &Path, rel: &str, files: &[(&str, &str)]) {
    let dir = root.join(rel);
    fs::create_dir_all(&dir).unwrap();
    for (name, text) in files {
        fs::write(dir.join(name), text).unwrap();
    }
}

fn v2_files() -> [(&'static str, &'static str); 2] {
    [
        ("cgroup.freeze", "0\n"),
        ("cgroup.events", "populated 1\nfrozen 0\n"),
    ]
}

#[test]
fn mountinfo_names_the_v1_freezer_and_the_shortest_cgroup2() {
    let roots = Roots::from_mountinfo(HYBRID);
    assert_eq!(
        roots.v1_freezer.as_deref(),
        Some(Path::new("/sys/fs/cgroup/freezer"))
    );
    assert_eq!(
        roots.v2.as_deref(),
        Some(Path::new("/sys/fs/cgroup/unified"))
    );
    assert_eq!(
        roots.v1_memory.as_deref(),
        Some(Path::new("/sys/fs/cgroup/memory"))
    );
    // A private mount namespace that mounted cgroup2 over /sys/fs/cgroup: the new mount is the shorter one.
    let over = format!("{HYBRID}90 30 0:27 / /sys/fs/cgroup rw - cgroup2 none rw\n");
    assert_eq!(
        Roots::from_mountinfo(&over).v2.as_deref(),
        Some(Path::new("/sys/fs/cgroup"))
    );
    // A bind mount of a sub-cgroup is no hierarchy root.
    let sub = "40 30 0:31 /docker /x rw - cgroup cgroup rw,freezer\n";
    assert_eq!(Roots::from_mountinfo(sub), Roots::default());
}

#[test]
fn a_runc_container_on_a_hybrid_host_uses_the_v1_freezer() {
    let dir = tempfile::tempdir().unwrap();
    let roots = Roots {
        v1_freezer: Some(dir.path().join("freezer")),
        v1_memory: None,
        v2: Some(dir.path().join("unified")),
    };
    cgroup_dir(
        &dir.path().join("freezer"),
        "default/c1",
        &[("freezer.state", "THAWED\n")],
    );
    cgroup_dir(&dir.path().join("unified"), "default/c1", &v2_files());
    let cgroups = [
        cg(6, &["freezer"], "/default/c1"),
        cg(0, &[], "/default/c1"),
    ];
    let f = Freezer::for_pid_in(7, &cgroups, &roots).unwrap();
    assert_eq!(f.version(), CgroupVersion::V1);
    assert_eq!(f.path(), dir.path().join("freezer/default/c1"));

    // runc in v2 mode leaves the v1 freezer line at the root: the v2 cgroup is used.
    let cgroups = [cg(6, &["freezer"], "/"), cg(0, &[], "/default/c1")];
    let f = Freezer::for_pid_in(7, &cgroups, &roots).unwrap();
    assert_eq!(f.version(), CgroupVersion::V2);
    assert_eq!(f.path(), dir.path().join("unified/default/c1"));
}

#[test]
fn roots_and_cgroups_without_a_freezer_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let cgroups = [cg(0, &[], "/")];
    let roots = Roots {
        v1_freezer: None,
        v1_memory: None,
        v2: Some(dir.path().to_path_buf()),
    };
    // The v2 root has no cgroup.freeze.
    match Freezer::for_pid_in(9, &cgroups, &roots) {
        Err(FreezerError::NotFreezable { pid: 9, path, file }) => {
            assert_eq!(path, dir.path());
            assert_eq!(file, "cgroup.freeze");
        }
        other => panic!("expected NotFreezable, got {other:?}"),
    }
    match Freezer::for_pid_in(9, &cgroups, &Roots::default()) {
        Err(e @ FreezerError::NoHierarchy { pid: 9 }) => assert!(e.to_string().contains("9")),
        other => panic!("expected NoHierarchy, got {other:?}"),
    }
}

#[test]
fn v1_writes_frozen_and_thawed_and_reads_the_state_back() {
    let dir = tempfile::tempdir().unwrap();
    cgroup_dir(dir.path(), "c", &[("freezer.state", "THAWED\n")]);
    let f = Freezer::open(&dir.path().join("c"), CgroupVersion::V1).unwrap();
    assert_eq!(f.state().unwrap(), FreezerState::Thawed);
    f.freeze_blocking(Duration::from_secs(1)).unwrap();
    assert_eq!(f.state().unwrap(), FreezerState::Frozen);
    f.thaw_blocking(Duration::from_secs(1)).unwrap();
    assert_eq!(
        fs::read_to_string(dir.path().join("c/freezer.state")).unwrap(),
        "THAWED\n"
    );
    fs::write(dir.path().join("c/freezer.state"), "MELTING\n").unwrap();
    assert!(matches!(f.state(), Err(FreezerError::Unexpected { text, .. }) if text == "MELTING"));
}

#[test]
fn v2_freeze_that_never_confirms_times_out_and_is_undone() {
    let dir = tempfile::tempdir().unwrap();
    cgroup_dir(dir.path(), "c", &v2_files());
    let f = Freezer::open(&dir.path().join("c"), CgroupVersion::V2).unwrap();
    let err = f.freeze_blocking(Duration::from_millis(20)).unwrap_err();
    match &err {
        FreezerError::Timeout {
            wanted,
            stuck_in,
            after,
            path,
        } => {
            assert_eq!(*wanted, FreezerState::Frozen);
            assert_eq!(*stuck_in, FreezerState::Freezing);
            assert!(*after >= Duration::from_millis(20));
            assert_eq!(path, &dir.path().join("c"));
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(err.to_string().contains("thawed again"), "{err}");
    assert_eq!(
        fs::read_to_string(dir.path().join("c/cgroup.freeze")).unwrap(),
        "0\n"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn v2_async_freeze_confirms_on_a_re_read_without_any_notification() {
    let dir = tempfile::tempdir().unwrap();
    cgroup_dir(dir.path(), "c", &v2_files());
    let f = Freezer::open(&dir.path().join("c"), CgroupVersion::V2).unwrap();
    let events = dir.path().join("c/cgroup.events");
    let freeze_file = dir.path().join("c/cgroup.freeze");
    // Plays the kernel: once `1` is written, reports `frozen 1` a little later (regular files never notify).
    let kernel = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while fs::read_to_string(&freeze_file).unwrap().trim() != "1" {
            assert!(std::time::Instant::now() < deadline, "freeze never written");
            std::thread::sleep(Duration::from_micros(100));
        }
        std::thread::sleep(Duration::from_millis(3));
        fs::write(&events, "populated 1\nfrozen 1\n").unwrap();
    });
    let took = f.freeze(Duration::from_secs(5)).await.unwrap();
    kernel.join().unwrap();
    assert!(took >= Duration::from_millis(3), "{took:?}");
    assert_eq!(f.state().unwrap(), FreezerState::Frozen);
    fs::write(
        dir.path().join("c/cgroup.events"),
        "populated 1\nfrozen 0\n",
    )
    .unwrap();
    f.thaw(Duration::from_secs(1)).await.unwrap();
    assert_eq!(f.state().unwrap(), FreezerState::Thawed);
}
