//! The task options containerd's Go client (and so `ctr`) sends: runc's `Options` for `io.containerd.runc.*`,
//! the legacy `containerd.linux.runc.CreateOptions` for any other runtime (Baton's). Each is honoured as runc-v2
//! honours its own: no pivot_root, stdio pipes owned by the user namespace's root, the shim's cgroup; and the
//! shim's OOM score follows containerd's.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use baton_integration::api::{self, StdioPaths};
use baton_integration::fifo::FifoReader;
use baton_integration::task_options::TaskOptions;
use baton_integration::{TestEnv, rootfs, skip};
use oci_spec::runtime::{LinuxIdMappingBuilder, LinuxNamespaceBuilder, LinuxNamespaceType, Spec};

const WAIT: Duration = Duration::from_secs(20);

/// Puts a `runc` first on containerd's PATH (so on the shims') that logs its arguments to `log`, then runs the
/// real runc.
fn log_runc_calls(env: &TestEnv, log: &Path) {
    let real = skip::which("runc").expect("runc on PATH");
    let wrapper = env.containerd().dir().join("bin").join("runc");
    let script = format!(
        "#!/bin/sh\necho \"$*\" >> '{}'\nexec '{}' \"$@\"\n",
        log.display(),
        real.display()
    );
    baton_integration::write_script(&wrapper, &script).expect("write runc wrapper");
}

#[test]
fn shim_ctr_run_no_pivot_reaches_runc() {
    let Some(env) = TestEnv::start("shim_no_pivot") else {
        return;
    };
    let log = env.scratch().join("runc-calls");
    log_runc_calls(&env, &log);
    let out = env.run(
        "nopivot",
        &[],
        &["--rm", "--no-pivot"],
        &["/bin/echo", "pivot-free"],
    );
    assert!(out.success(), "ctr run --no-pivot failed: {}", out.stderr);
    assert_eq!(out.stdout.trim(), "pivot-free");
    let calls = std::fs::read_to_string(&log).unwrap_or_default();
    let create = calls
        .lines()
        .find(|line| line.split_whitespace().any(|arg| arg == "create"))
        .unwrap_or_else(|| panic!("no runc create among the calls:\n{calls}"));
    assert!(
        create.split_whitespace().any(|arg| arg == "--no-pivot"),
        "runc create without --no-pivot: {create}"
    );
}

/// Host ids the container's user namespace maps its root to.
const USERNS_HOST_ID: u32 = 100_000;

/// `spec` with a user namespace mapping 0..65536 to [`USERNS_HOST_ID`]...
fn with_user_namespace(mut spec: Spec) -> Spec {
    let mapping = LinuxIdMappingBuilder::default()
        .container_id(0u32)
        .host_id(USERNS_HOST_ID)
        .size(65_536u32)
        .build()
        .expect("id mapping");
    let user = LinuxNamespaceBuilder::default()
        .typ(LinuxNamespaceType::User)
        .build()
        .expect("user namespace");
    if let Some(linux) = spec.linux_mut() {
        linux
            .namespaces_mut()
            .get_or_insert_with(Vec::new)
            .push(user);
        linux.set_uid_mappings(Some(vec![mapping]));
        linux.set_gid_mappings(Some(vec![mapping]));
    }
    spec
}

#[test]
fn shim_user_namespace_container_writes_its_stdio() {
    let Some(env) = TestEnv::start("shim_userns_stdio") else {
        return;
    };
    // The container's root is host uid 100000: it must be able to walk to the bundle's rootfs.
    std::fs::set_permissions(
        env.containerd().dir(),
        std::fs::Permissions::from_mode(0o711),
    )
    .expect("chmod the test folder");
    let api = env.api().expect("api");
    let id = "userns";
    // Reopening /dev/stdout (a pipe) checks the pipe's owner: IoUid/IoGid give it to the container's root.
    let script = "echo to-stdout > /dev/stdout && echo to-stderr > /dev/stderr";
    let spec = rootfs::spec(
        env.namespace(),
        id,
        &["/bin/sh", "-c", script],
        None,
        &HashMap::new(),
    )
    .expect("spec");
    let json = serde_json::to_vec(&with_user_namespace(spec)).expect("spec json");
    api.create_container(id, env.runtime(), json, None, Default::default())
        .expect("create container");
    let stdout = FifoReader::create(&env.scratch().join("out")).expect("stdout fifo");
    let stderr = FifoReader::create(&env.scratch().join("err")).expect("stderr fifo");
    let stdio = StdioPaths {
        stdout: stdout.path().display().to_string(),
        stderr: stderr.path().display().to_string(),
        ..Default::default()
    };
    // What `ctr run --uidmap 0:100000:65536 --gidmap 0:100000:65536` adds to the task.
    let options = TaskOptions {
        io_uid: USERNS_HOST_ID,
        io_gid: USERNS_HOST_ID,
        ..Default::default()
    }
    .for_runtime(env.runtime());
    api.create_task_with_options(
        id,
        &stdio,
        vec![api::bind_rootfs(env.rootfs())],
        Some(options),
    )
    .expect("create a user-namespaced task with IoUid/IoGid");
    api.start(id, "").expect("start");
    let code = api.wait(id, "", WAIT).expect("wait");
    let out = stdout.finish(WAIT).expect("stdout");
    let err = stderr.finish(WAIT).expect("stderr");
    assert_eq!(code, 0, "the container could not write its stdio: {err}");
    assert_eq!(out.trim(), "to-stdout");
    assert_eq!(err.trim(), "to-stderr");
}

/// A cgroup made in every hierarchy for a test (cpuset gets its parent's cpus and mems so tasks can join),
/// removed on drop (after the test's containerd and shims are gone).
struct TestCgroup {
    path: String,
    dirs: Vec<PathBuf>,
}

impl TestCgroup {
    fn create(path: &str) -> Self {
        let mut dirs = Vec::new();
        let hierarchies = std::fs::read_dir("/sys/fs/cgroup").expect("list /sys/fs/cgroup");
        for hierarchy in hierarchies.filter_map(Result::ok) {
            let root = hierarchy.path();
            let is_mount = !hierarchy.file_type().is_ok_and(|t| t.is_symlink())
                && root.join("cgroup.procs").exists();
            if !is_mount {
                continue;
            }
            let dir = root.join(path.trim_start_matches('/'));
            std::fs::create_dir_all(&dir)
                .unwrap_or_else(|e| panic!("create cgroup {}: {e}", dir.display()));
            for inherited in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(value) = std::fs::read_to_string(root.join(inherited)) {
                    std::fs::write(dir.join(inherited), value.trim())
                        .unwrap_or_else(|e| panic!("set {inherited} of {}: {e}", dir.display()));
                }
            }
            dirs.push(dir);
        }
        Self {
            path: path.to_string(),
            dirs,
        }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + WAIT;
        for dir in &self.dirs {
            while std::fs::remove_dir(dir).is_err() && dir.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// The cgroup of `pid` in the v1 memory hierarchy (or the v2 tree when there is none).
fn memory_cgroup_of(pid: i32) -> String {
    let table = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let line = |wanted: &dyn Fn(&str) -> bool| {
        table.lines().find_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            wanted(controllers).then(|| path.to_string())
        })
    };
    line(&|c| c.split(',').any(|c| c == "memory"))
        .or_else(|| line(&|c| c.is_empty()))
        .unwrap_or_default()
}

#[test]
fn shim_cgroup_option_holds_the_shim() {
    if skip::missing_containerd_prerequisite().is_some() {
        skip::announce("containerd prerequisites missing");
        return;
    }
    // Made before (so dropped after) the environment that kills the shim inside it.
    let cgroup = TestCgroup::create(&format!("/baton-shim-cgroup-{}", std::process::id()));
    let Some(env) = TestEnv::start("shim_cgroup_option") else {
        return;
    };
    let api = env.api().expect("api");
    let id = "shimcg";
    let spec = rootfs::spec(
        env.namespace(),
        id,
        &["/bin/sleep", "300"],
        None,
        &HashMap::new(),
    )
    .expect("spec");
    let json = serde_json::to_vec(&spec).expect("spec json");
    api.create_container(id, env.runtime(), json, None, Default::default())
        .expect("create container");
    let options = TaskOptions {
        shim_cgroup: cgroup.path.clone(),
        ..Default::default()
    }
    .for_runtime(env.runtime());
    api.create_task_with_options(
        id,
        &StdioPaths::default(),
        vec![api::bind_rootfs(env.rootfs())],
        Some(options),
    )
    .expect("create a task with ShimCgroup");
    let shims = env.shims();
    assert_eq!(shims.len(), 1, "{shims:?}");
    assert_eq!(
        memory_cgroup_of(shims[0].pid),
        cgroup.path,
        "the shim is not in its ShimCgroup"
    );
}

fn oom_score_adj(pid: u32) -> i32 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .unwrap_or_else(|e| panic!("read oom_score_adj of {pid}: {e}"));
    text.trim().parse().expect("oom_score_adj is a number")
}

#[test]
fn shim_oom_score_is_containerds_plus_one() {
    let Some(env) = TestEnv::start("shim_oom_score") else {
        return;
    };
    let containerd = env.containerd().pid().expect("containerd pid");
    // containerd's score + 1, capped at the maximum (1000), as the Go shim's AdjustOOMScore does. (Raised
    // only: lowering a score needs CAP_SYS_RESOURCE, which the test machines' root may lack.)
    for (id, containerd_score, shim_score) in [("oommid", 500, 501), ("oomtop", 1000, 1000)] {
        std::fs::write(
            format!("/proc/{containerd}/oom_score_adj"),
            containerd_score.to_string(),
        )
        .expect("set containerd's oom_score_adj");
        env.run_detached(id, &[], &["/bin/sleep", "300"])
            .expect("run");
        let shim = env
            .shims()
            .into_iter()
            .find(|shim| shim.cmdline.iter().any(|arg| arg == id))
            .unwrap_or_else(|| panic!("no shim for {id}"));
        let pid = u32::try_from(shim.pid).expect("pid");
        assert_eq!(
            oom_score_adj(pid),
            shim_score,
            "shim of {id} with containerd at {containerd_score}"
        );
    }
}
