//! Checkpoint and restore through runc (which the runc crate does not cover): the command lines
//! are built by pure functions, as the Go shim (go-runc) builds them, and run by the shim's
//! reaper-safe executor.

use std::path::PathBuf;

use containerd_shim_protos::{
    protobuf::{Message, well_known_types::any::Any},
    shim::oci::{CheckpointOptions, Options as RuncOptions},
};

use crate::{
    errors::{Result, ShimError},
    runtime::RuncGlobal,
};

/// What CRIU is asked to do, from the request and its `CheckpointOptions`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CriuOpts {
    /// `--image-path`.
    pub image_path: String,
    /// `--work-path` (empty: not passed).
    pub work_path: String,
    /// `--parent-path` (empty: not passed).
    pub parent_path: String,
    /// Stop the container after the checkpoint (otherwise `--leave-running`).
    pub exit: bool,
    /// `--tcp-established`.
    pub open_tcp: bool,
    /// `--ext-unix-sk`.
    pub external_unix_sockets: bool,
    /// `--shell-job`.
    pub terminal: bool,
    /// `--file-locks`.
    pub file_locks: bool,
    /// `--empty-ns` (one flag per namespace).
    pub empty_namespaces: Vec<String>,
    /// `--manage-cgroups-mode`.
    pub cgroups_mode: String,
}

impl CriuOpts {
    /// Options of a Checkpoint call: `path` is the request's image path; `options` the
    /// `containerd.runc.v1.CheckpointOptions` it carries (an image/work path there wins, as in Go).
    pub fn for_checkpoint(path: &str, options: Option<&Any>, runc: &RuncOptions) -> Result<Self> {
        let opts = match options.filter(|a| !a.value.is_empty()) {
            Some(any) => CheckpointOptions::parse_from_bytes(&any.value)
                .map_err(|e| ShimError::InvalidArgument(format!("checkpoint options: {e}")))?,
            None => CheckpointOptions::new(),
        };
        let image_path = if opts.image_path.is_empty() {
            path.to_string()
        } else {
            opts.image_path.clone()
        };
        if image_path.is_empty() {
            return Err(ShimError::InvalidArgument(
                "checkpoint: no image path in the request or its options".into(),
            ));
        }
        let work_path = if opts.work_path.is_empty() {
            runc.criu_work_path.clone()
        } else {
            opts.work_path.clone()
        };
        Ok(Self {
            image_path,
            work_path,
            parent_path: String::new(),
            exit: opts.exit,
            open_tcp: opts.open_tcp,
            external_unix_sockets: opts.external_unix_sockets,
            terminal: opts.terminal,
            file_locks: opts.file_locks,
            empty_namespaces: opts.empty_namespaces.clone(),
            cgroups_mode: opts.cgroups_mode.clone(),
        })
    }

    /// Options of a restore on Create: the request's `checkpoint` and `parent_checkpoint`.
    pub fn for_restore(checkpoint: &str, parent: &str, runc: &RuncOptions) -> Self {
        Self {
            image_path: checkpoint.to_string(),
            work_path: runc.criu_work_path.clone(),
            parent_path: parent.to_string(),
            ..Default::default()
        }
    }

    fn args(&self) -> Vec<String> {
        let mut args = vec!["--image-path".to_string(), self.image_path.clone()];
        for (flag, value) in [
            ("--work-path", &self.work_path),
            ("--parent-path", &self.parent_path),
        ] {
            if !value.is_empty() {
                args.push(flag.to_string());
                args.push(value.clone());
            }
        }
        for (flag, on) in [
            ("--tcp-established", self.open_tcp),
            ("--ext-unix-sk", self.external_unix_sockets),
            ("--shell-job", self.terminal),
            ("--file-locks", self.file_locks),
        ] {
            if on {
                args.push(flag.to_string());
            }
        }
        for ns in &self.empty_namespaces {
            args.push("--empty-ns".to_string());
            args.push(ns.clone());
        }
        if !self.cgroups_mode.is_empty() {
            args.push("--manage-cgroups-mode".to_string());
            args.push(self.cgroups_mode.clone());
        }
        args
    }
}

/// `runc <global> [--criu C] checkpoint <criu flags> [--leave-running] <id>`.
pub fn checkpoint_args(global: &RuncGlobal, id: &str, criu: &CriuOpts) -> Vec<String> {
    let mut args = global.args();
    args.extend(global.criu_flags().0);
    args.push("checkpoint".to_string());
    args.extend(criu.args());
    if !criu.exit {
        args.push("--leave-running".to_string());
    }
    args.push(id.to_string());
    args
}

/// Where a restored process's pid and console go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreTarget {
    /// The bundle (`--bundle`).
    pub bundle: PathBuf,
    /// `--pid-file`.
    pub pid_file: PathBuf,
    /// `--console-socket` for a TTY container.
    pub console_socket: Option<PathBuf>,
    /// `--no-pivot`.
    pub no_pivot: bool,
}

/// `runc <global> [--criu C] restore <criu flags> --detach --pid-file P --no-subreaper [...] --bundle B <id>`.
pub fn restore_args(
    global: &RuncGlobal,
    id: &str,
    criu: &CriuOpts,
    target: &RestoreTarget,
) -> Vec<String> {
    let mut args = global.args();
    args.extend(global.criu_flags().0);
    args.push("restore".to_string());
    args.extend(criu.args());
    args.push("--detach".to_string());
    args.push("--pid-file".to_string());
    args.push(target.pid_file.display().to_string());
    args.push("--no-subreaper".to_string());
    if target.no_pivot {
        args.push("--no-pivot".to_string());
    }
    if let Some(sock) = &target.console_socket {
        args.push("--console-socket".to_string());
        args.push(sock.display().to_string());
    }
    args.push("--bundle".to_string());
    args.push(target.bundle.display().to_string());
    args.push(id.to_string());
    args
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn global() -> RuncGlobal {
        let mut o = RuncOptions::new();
        o.binary_name = "/usr/sbin/runc".into();
        RuncGlobal::new(&o, "k8s.io", Path::new("/run/b/c1"))
    }

    #[test]
    fn global_flags_match_go_runc() {
        assert_eq!(
            global().args(),
            [
                "--root",
                "/run/containerd/runc/k8s.io",
                "--log",
                "/run/b/c1/log.json",
                "--log-format",
                "json"
            ]
        );
        let mut o = RuncOptions::new();
        o.root = "/x".into();
        o.systemd_cgroup = true;
        let g = RuncGlobal::new(&o, "default", Path::new("/b"));
        assert_eq!(g.binary, PathBuf::from("runc"));
        assert!(g.args().ends_with(&["--systemd-cgroup".to_string()]));
        assert_eq!(g.root, PathBuf::from("/x/default"));
    }

    #[test]
    fn checkpoint_leaves_running_unless_exit() {
        let criu = CriuOpts::for_checkpoint("/img", None, &RuncOptions::new()).unwrap();
        let args = checkpoint_args(&global(), "c1", &criu);
        assert_eq!(
            &args[6..],
            [
                "checkpoint",
                "--image-path",
                "/img",
                "--leave-running",
                "c1"
            ]
        );
        let mut opts = CheckpointOptions::new();
        opts.exit = true;
        opts.open_tcp = true;
        opts.terminal = true;
        opts.work_path = "/work".into();
        opts.empty_namespaces = vec!["network".into()];
        opts.cgroups_mode = "soft".into();
        let any = Any {
            type_url: "containerd.runc.v1.CheckpointOptions".into(),
            value: opts.write_to_bytes().unwrap(),
            ..Default::default()
        };
        let criu = CriuOpts::for_checkpoint("/img", Some(&any), &RuncOptions::new()).unwrap();
        let args = checkpoint_args(&global(), "c1", &criu);
        assert_eq!(
            &args[6..],
            [
                "checkpoint",
                "--image-path",
                "/img",
                "--work-path",
                "/work",
                "--tcp-established",
                "--shell-job",
                "--empty-ns",
                "network",
                "--manage-cgroups-mode",
                "soft",
                "c1"
            ]
        );
    }

    #[test]
    fn checkpoint_options_image_path_wins_and_empty_path_is_refused() {
        let mut opts = CheckpointOptions::new();
        opts.image_path = "/other".into();
        let any = Any {
            value: opts.write_to_bytes().unwrap(),
            ..Default::default()
        };
        let criu = CriuOpts::for_checkpoint("/img", Some(&any), &RuncOptions::new()).unwrap();
        assert_eq!(criu.image_path, "/other");
        assert!(matches!(
            CriuOpts::for_checkpoint("", None, &RuncOptions::new()),
            Err(ShimError::InvalidArgument(_))
        ));
    }

    #[test]
    fn restore_detaches_without_subreaper() {
        let mut o = RuncOptions::new();
        o.criu_work_path = "/wp".into();
        let criu = CriuOpts::for_restore("/ckpt", "/parent", &o);
        let target = RestoreTarget {
            bundle: "/run/b/c1".into(),
            pid_file: "/run/b/c1/init.pid".into(),
            console_socket: Some("/tmp/pty.sock".into()),
            no_pivot: true,
        };
        let args = restore_args(&global(), "c1", &criu, &target);
        assert_eq!(
            &args[6..],
            [
                "restore",
                "--image-path",
                "/ckpt",
                "--work-path",
                "/wp",
                "--parent-path",
                "/parent",
                "--detach",
                "--pid-file",
                "/run/b/c1/init.pid",
                "--no-subreaper",
                "--no-pivot",
                "--console-socket",
                "/tmp/pty.sock",
                "--bundle",
                "/run/b/c1",
                "c1"
            ]
        );
    }
}
