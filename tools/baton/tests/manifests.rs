//! The Kubernetes manifests under tools/kubernetes/, checked against the real Kubernetes OpenAPI schemas
//! with kubernetes-validate (PyPI, offline; tools/setup.sh installs it) since no cluster runs here, in
//! strict mode (an unknown field fails). Broken copies must fail, so that the check is known to bite.
//! Then the facts the manifests share: the pool's label and taint, the agent's privileges.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../kubernetes");
const MANIFESTS: [&str; 3] = ["runtimeclass.yaml", "baton-agent.yaml", "example-pods.yaml"];

/// The validator: `$BATON_KUBERNETES_VALIDATE`, else `kubernetes-validate` on PATH.
fn validator() -> Option<PathBuf> {
    let program = std::env::var_os("BATON_KUBERNETES_VALIDATE")
        .map_or_else(|| PathBuf::from("kubernetes-validate"), PathBuf::from);
    Command::new(&program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
        .then_some(program)
}

/// Runs the validator in strict mode; returns (passed, its output).
fn validate(program: &Path, file: &Path) -> (bool, String) {
    let out = Command::new(program)
        .args(["--strict", "--kubernetes-version", "1.37.0"])
        .arg(file)
        .output()
        .expect("run kubernetes-validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn read(name: &str) -> String {
    std::fs::read_to_string(Path::new(DIR).join(name)).expect("read manifest")
}

#[test]
fn manifests_match_the_kubernetes_schemas_and_broken_copies_do_not() {
    let Some(program) = validator() else {
        baton_prereq::missing(
            "kubernetes-validate is not installed (tools/setup.sh installs it from PyPI)",
        );
        return;
    };
    for name in MANIFESTS {
        let (ok, out) = validate(&program, &Path::new(DIR).join(name));
        eprintln!("{out}");
        assert!(ok, "{name}: {out}");
        assert!(out.contains("passed"), "{name}: {out}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = read("baton-agent.yaml");
    let broken = [
        (
            "unknown-field.yaml",
            agent.replace("hostPID: true", "hostPid: true"),
            "hostPid",
        ),
        (
            "wrong-type.yaml",
            agent.replace("hostPID: true", "hostPID: \"yes\""),
            "hostPID",
        ),
        (
            "no-handler.yaml",
            read("runtimeclass.yaml").replace("handler: baton\n", ""),
            "handler",
        ),
    ];
    for (name, text, field) in broken {
        assert!(!text.is_empty());
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        let (ok, out) = validate(&program, &path);
        assert!(!ok, "{name} passed: {out}");
        assert!(out.contains(field), "{name}: {out}");
    }
}

#[test]
fn the_pool_label_and_taint_are_the_same_everywhere() {
    let selector = "  nodeSelector:\n    baton.io/gpu-pool: shared\n";
    let toleration = "    - key: baton.io/gpu-pool\n      operator: Equal\n      value: shared\n      effect: NoSchedule\n";
    let runtime_class = read("runtimeclass.yaml");
    assert!(runtime_class.contains(selector), "{runtime_class}");
    assert!(runtime_class.contains(toleration), "{runtime_class}");
    let indent = |text: &str, by: usize| {
        text.lines()
            .map(|l| format!("{}{l}\n", " ".repeat(by)))
            .collect::<String>()
    };
    let agent = read("baton-agent.yaml");
    assert!(
        agent.contains(&indent(selector, 4)),
        "DaemonSet nodeSelector"
    );
    assert!(
        agent.contains(&indent(toleration, 4)),
        "DaemonSet toleration"
    );
    let pods = read("example-pods.yaml");
    assert_eq!(pods.matches("\n  runtimeClassName: baton\n").count(), 2);
    assert!(pods.contains("baton.io/role: latency-critical"));
    assert!(pods.contains("baton.io/role: co-runner"));
}

#[test]
fn the_agent_gets_only_justified_capabilities_and_the_installer_none() {
    let agent = read("baton-agent.yaml");
    let added: Vec<(&str, &str)> = {
        let lines: Vec<&str> = agent.lines().collect();
        let start = lines
            .iter()
            .position(|l| l.trim() == "add:")
            .expect("capabilities add");
        lines[start + 1..]
            .iter()
            .enumerate()
            .take_while(|(_, l)| l.trim_start().starts_with('-') || l.trim_start().starts_with('#'))
            .filter_map(|(i, l)| {
                let cap = l.trim().strip_prefix("- ")?;
                Some((cap, lines[start + i].trim()))
            })
            .collect()
    };
    let caps: Vec<&str> = added.iter().map(|(c, _)| *c).collect();
    assert_eq!(
        caps,
        [
            "BPF",
            "PERFMON",
            "SYS_ADMIN",
            "SYS_PTRACE",
            "DAC_READ_SEARCH"
        ]
    );
    for (cap, line_above) in added {
        assert!(
            line_above.starts_with('#'),
            "{cap} has no comment saying why"
        );
    }
    assert!(!agent.contains("privileged: true"));
    assert_eq!(
        agent.matches("drop: [\"ALL\"]").count(),
        2,
        "both containers drop all"
    );
    assert_eq!(agent.matches("allowPrivilegeEscalation: false").count(), 2);
    assert!(agent.contains("hostPID: true"));
    assert!(agent.contains("automountServiceAccountToken: false"));
    for arg in [
        "--config",
        "/host/etc/containerd/config.toml",
        "--agent",
        "daemonset",
        "--bin-dir",
    ] {
        assert!(
            agent.contains(&format!("- {arg}\n")),
            "install container: {arg}"
        );
    }
}
