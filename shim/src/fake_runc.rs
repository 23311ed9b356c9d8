//! Test support: a fake runc, a shell script in a temporary directory that records every command
//! line it is given and what its stdin was, plays a container's init with an ordinary process
//! (which copies its stdin to a file and then sleeps), and fails any subcommand on demand the way
//! runc does (message on stderr and in its JSON `--log`, exit status 1).
//!
//! The played process outlives the fake runc, as a container's init outlives runc, so this test
//! process becomes a child subreaper (as the shim server is) and [`exclusive`] runs the shim's
//! reaper: exits reach the shim through the same path as in production.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::Duration,
};

use containerd_shim_protos::protobuf::{CodedOutputStream, well_known_types::any::Any};
use tempfile::TempDir;
use tokio::sync::{Mutex, MutexGuard};

const SCRIPT: &str = r#"#!/bin/sh
D='@DIR@'
echo "$*" >> "$D/calls"
log=""
while [ $# -gt 0 ]; do
  case "$1" in
    --root|--log-format|--criu) shift 2 ;;
    --log) log=$2; shift 2 ;;
    --systemd-cgroup|--debug) shift ;;
    *) break ;;
  esac
done
cmd=$1; shift
[ -e "$D/block-$cmd" ] && : > "$D/blocked-$cmd"
while [ -e "$D/block-$cmd" ]; do sleep 0.01; done
if [ -e "$D/fail-$cmd" ]; then
  msg=$(cat "$D/fail-$cmd")
  [ -n "$log" ] && printf '{"level":"error","msg":"%s"}\n' "$msg" >> "$log"
  echo "$msg" >&2
  exit 1
fi
pidfile=""; prev=""; last=""; penult=""
for a in "$@"; do
  [ "$prev" = "--pid-file" ] && pidfile=$a
  prev=$a; penult=$last; last=$a
done
case $cmd in
  create|restore)
    if [ -e "$D/init-dies-$cmd" ]; then
      # The init dies before runc returns. Forked twice, it dies only once it is the shim's
      # (the subreaper's) child, not a shell's, so the shim reaps it.
      dead=$(sh -c 'sh -c '\''while [ "$(cut -d" " -f4 /proc/$$/stat)" = "$0" ]; do sleep 0.01; done
        exit 3'\'' "$$" </dev/null >/dev/null 2>&1 & echo $!')
      while [ -e "/proc/$dead" ] && ! grep -q '^State:.*Z' "/proc/$dead/status" 2>/dev/null; do
        sleep 0.01
      done
      rm -f "$D/init-dies-$cmd"
      echo $dead > "$D/$last.pid"
      [ -n "$pidfile" ] && printf %s $dead > "$pidfile"
      exit 0
    fi
    readlink /proc/$$/fd/0 > "$D/$last.$cmd-stdin"
    # Through another fd: an asynchronous list gets /dev/null as stdin otherwise (dash applies
    # that even over `0<&0`).
    exec 3<&0
    sh -c 'cat > "$1"; : > "$1.eof"; exec sleep 1000' fake-init "$D/$last.input" 0<&3 3<&- &
    exec 3<&-
    echo $! > "$D/$last.pid"
    [ -n "$pidfile" ] && printf %s $! > "$pidfile"
    ;;
  exec)
    # An exec process: a sleeper that holds none of runc's pipes.
    sh -c 'exec sleep 1000' </dev/null >/dev/null 2>&1 &
    echo $! >> "$D/$last.exec-pids"
    [ -n "$pidfile" ] && printf %s $! > "$pidfile"
    ;;
  kill)
    kill -"$last" "$(cat "$D/$penult.pid")"
    # --all: every process of the container, the exec processes too.
    case " $* " in
      *" --all "*) for p in $(cat "$D/$penult.exec-pids" 2>/dev/null); do kill -"$last" "$p"; done ;;
    esac
    ;;
  pause) kill -STOP "$(cat "$D/$last.pid")" ;;
  resume) kill -CONT "$(cat "$D/$last.pid")" ;;
  checkpoint)
    case " $* " in
      *" --leave-running "*) ;;
      *) kill -KILL "$(cat "$D/$last.pid")" ;;
    esac
    ;;
  delete)
    [ -e "$D/$last.pid" ] && kill -KILL "$(cat "$D/$last.pid")" 2>/dev/null
    rm -f "$D/$last.pid"
    ;;
esac
exit 0
"#;

/// A fake runc in its own temporary directory.
pub struct FakeRunc {
    dir: TempDir,
    /// The script, for `BinaryName`.
    pub binary: PathBuf,
}

/// Serialises the tests that drive containers (they share the process-wide reaper table and
/// exit monitor), makes this process a child subreaper, and runs the shim's reaper on the
/// caller's runtime. Hold the guard for the whole test.
pub async fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::const_new(());
    let guard = LOCK.lock().await;
    nix::sys::prctl::set_child_subreaper(true).expect("become child subreaper");
    tokio::spawn(crate::reaper::reap_children());
    // Let the reaper install its SIGCHLD handler before anything is spawned.
    tokio::task::yield_now().await;
    guard
}

impl FakeRunc {
    /// Writes the script.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let binary = dir.path().join("runc");
        let script = SCRIPT.replace("@DIR@", &dir.path().display().to_string());
        std::fs::write(&binary, script).expect("write fake runc");
        std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755))
            .expect("chmod fake runc");
        std::fs::create_dir(dir.path().join("root")).expect("runc root");
        Self { dir, binary }
    }

    /// The fake's directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Makes `cmd` wait, once it is called, until [`Self::unblock`]; returns at once.
    pub fn block(&self, cmd: &str) {
        std::fs::write(self.dir().join(format!("block-{cmd}")), "").expect("block file");
    }

    /// Lets blocked `cmd` calls go on.
    pub fn unblock(&self, cmd: &str) {
        let _ = std::fs::remove_file(self.dir().join(format!("block-{cmd}")));
    }

    /// Waits until a call of blocked `cmd` is waiting.
    pub async fn wait_blocked(&self, cmd: &str) {
        let marker = self.dir().join(format!("blocked-{cmd}"));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !marker.exists() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "runc {cmd} was never called"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Makes the next `cmd` (create or restore) leave an init that dies before runc returns.
    pub fn init_dies_during(&self, cmd: &str) {
        std::fs::write(self.dir().join(format!("init-dies-{cmd}")), "").expect("marker");
    }

    /// A bundle for container `id` with a minimal config.json (no rootfs mounts) and a pid
    /// namespace of its own.
    pub fn bundle(&self, id: &str) -> PathBuf {
        self.bundle_with(id, r#"{"namespaces":[{"type":"pid"},{"type":"mount"}]}"#)
    }

    /// A bundle for container `id` that shares the host's pid namespace.
    pub fn bundle_in_host_pid_namespace(&self, id: &str) -> PathBuf {
        self.bundle_with(id, r#"{"namespaces":[{"type":"mount"}]}"#)
    }

    fn bundle_with(&self, id: &str, linux: &str) -> PathBuf {
        let bundle = self.dir().join("bundles").join(id);
        std::fs::create_dir_all(&bundle).expect("bundle dir");
        let config = format!(
            r#"{{"ociVersion":"1.0.2","process":{{"cwd":"/","args":["sleep","1000"],"user":{{"uid":0,"gid":0}}}},"root":{{"path":"rootfs"}},"linux":{linux}}}"#
        );
        std::fs::write(bundle.join("config.json"), config).expect("config.json");
        bundle
    }

    /// A fifo at `dir/name`, as containerd creates for a process's stdio.
    pub fn fifo(&self, name: &str) -> PathBuf {
        let path = self.dir().join(name);
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
        path
    }

    /// The runtime options a CRI Create carries for a non-runc runtime type: a
    /// `runtimeoptions.v1.Options` whose TOML selects this fake and turns the eBPF probes off.
    pub fn options(&self) -> Any {
        let body = format!(
            "BinaryName = {:?}\nRoot = {:?}\nebpf = false\n",
            self.binary.display().to_string(),
            self.dir().join("root").display().to_string()
        );
        let mut value = Vec::new();
        let mut os = CodedOutputStream::vec(&mut value);
        os.write_string(1, "io.containerd.baton.v1")
            .expect("encode");
        os.write_string(3, &body).expect("encode");
        os.flush().expect("encode");
        drop(os);
        Any {
            type_url: "runtimeoptions.v1.Options".into(),
            value,
            ..Default::default()
        }
    }

    /// Makes subcommand `cmd` fail with `message` until [`Self::heal`].
    pub fn fail(&self, cmd: &str, message: &str) {
        std::fs::write(self.dir().join(format!("fail-{cmd}")), message).expect("fail file");
    }

    /// Makes subcommand `cmd` succeed again.
    pub fn heal(&self, cmd: &str) {
        std::fs::remove_file(self.dir().join(format!("fail-{cmd}"))).expect("heal");
    }

    /// The command lines run since the last call, each without the global flags, which are
    /// checked to be exactly `global` on every line.
    pub fn take_calls(&self, global: &[String]) -> Vec<String> {
        let path = self.dir().join("calls");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let _ = std::fs::remove_file(&path);
        let prefix = format!("{} ", global.join(" "));
        text.lines()
            .map(|line| {
                line.strip_prefix(&prefix)
                    .unwrap_or_else(|| panic!("{line:?} lacks the global flags {prefix:?}"))
                    .to_string()
            })
            .collect()
    }

    /// What a checkpoint or restore call starts with before its subcommand: `--criu PATH ` when the
    /// default settings name a CRIU (the one tools/setup.sh caches, where it exists), else nothing.
    pub fn criu_prefix() -> String {
        crate::options::BatonSettings::default()
            .criu_program()
            .map_or_else(String::new, |c| format!("--criu {} ", c.display()))
    }

    /// What the played init of `id` has read from its stdin so far.
    pub fn input_of(&self, id: &str) -> String {
        std::fs::read_to_string(self.dir().join(format!("{id}.input"))).unwrap_or_default()
    }

    /// Waits (5 s at most) until the played init of `id` has read `expected` from its stdin.
    pub async fn wait_for_input(&self, id: &str, expected: &str) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let got = self.input_of(id);
            if got == expected || tokio::time::Instant::now() > deadline {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the played init of `id` has seen the end of its stdin.
    pub fn input_ended(&self, id: &str) -> bool {
        self.dir().join(format!("{id}.input.eof")).exists()
    }

    /// What runc's stdin was when it ran `cmd` (`create` or `restore`) for `id`
    /// (`/proc/<runc>/fd/0`'s link: `pipe:[...]`, `/dev/null`, ...).
    pub fn stdin_of(&self, id: &str, cmd: &str) -> String {
        std::fs::read_to_string(self.dir().join(format!("{id}.{cmd}-stdin")))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    /// The pid of the played init of `id`, while it is known to the fake.
    pub fn pid_of(&self, id: &str) -> Option<i32> {
        std::fs::read_to_string(self.dir().join(format!("{id}.pid")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for FakeRunc {
    /// Kills the played inits still running.
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(self.dir()) else {
            return;
        };
        for entry in entries.flatten() {
            if entry.path().extension().is_some_and(|e| e == "pid")
                && let Ok(text) = std::fs::read_to_string(entry.path())
                && let Ok(pid) = text.trim().parse::<i32>()
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}
