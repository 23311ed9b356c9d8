//! The shim's own lifecycle (containerd's `start` and `delete` actions), through the crate's `Shim`
//! trait: grouping containers of a pod into one shim, and cleaning up after a dead shim. (`-info` is
//! answered by main.rs through info.rs.)

use std::{path::Path, sync::Arc, time::SystemTime};

use async_trait::async_trait;
use containerd_shim::{
    Config, DeleteResponse, ExitSignal, Flags, StartOpts,
    asynchronous::{
        publisher::RemotePublisher,
        spawn,
        util::{read_options, write_str_to_file},
    },
    protos::protobuf::MessageField,
};
use runc::options::DeleteOpts;

use crate::{
    events::{Events, timestamp},
    options::{GROUP_ANNOTATION, SANDBOX_ID_ANNOTATION, decode_options},
    runtime,
    runtime::RuncGlobal,
    service::TaskService,
};

/// Environment variable carrying a TOML `ShimCgroup` from `start` to the shim server.
pub const SHIM_CGROUP_ENV: &str = "BATON_SHIM_CGROUP";

/// The Baton shim.
pub struct BatonShim {
    namespace: String,
    id: String,
    exit: Arc<ExitSignal>,
}

/// The group (shim) a container joins: its pod's sandbox id, or the runc group annotation, or
/// its own id. Read from the bundle's config.json.
pub fn grouping_id(bundle: &Path, id: &str) -> String {
    let Ok(spec) = crate::container::load_spec(bundle) else {
        return id.to_string();
    };
    let annotations = spec.annotations().clone().unwrap_or_default();
    annotations
        .get(SANDBOX_ID_ANNOTATION)
        .or_else(|| annotations.get(GROUP_ANNOTATION))
        .filter(|g| !g.is_empty())
        .cloned()
        .unwrap_or_else(|| id.to_string())
}

impl BatonShim {
    /// The Task service, publishing events to containerd's ttrpc `address`.
    pub fn task_service(&self, address: &str) -> TaskService {
        TaskService::new(
            &self.namespace,
            Events::new(address, &self.namespace),
            self.exit.clone(),
        )
    }
}

#[async_trait]
impl containerd_shim::Shim for BatonShim {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        Self {
            namespace: args.namespace.clone(),
            id: args.id.clone(),
            exit: Arc::new(ExitSignal::default()),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> containerd_shim::Result<String> {
        let cwd = std::env::current_dir().unwrap_or_default();
        let grouping = grouping_id(&cwd, &opts.id);
        // runc's Options carry ShimCgroup for the crate; the TOML form travels in the env.
        let shim_cgroup = opts
            .extensions
            .iter()
            .find_map(|any| decode_options(Some(any)).ok())
            .map(|cfg| cfg.runc.shim_cgroup)
            .unwrap_or_default();
        let vars = if shim_cgroup.is_empty() {
            vec![]
        } else {
            vec![(SHIM_CGROUP_ENV, shim_cgroup.as_str())]
        };
        let address = spawn(opts, &grouping, vars).await?;
        write_str_to_file("address", &address).await?;
        Ok(address)
    }

    async fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        let bundle = std::env::current_dir().unwrap_or_default();
        let options = read_options(&bundle).await.unwrap_or_default();
        let global = RuncGlobal::new(&options, &self.namespace, &bundle);
        match runtime::runc_client(&global) {
            Ok(runc) => {
                if let Err(e) = runc
                    .delete(&self.id, Some(&DeleteOpts::new().force(true)))
                    .await
                {
                    tracing::warn!(id = %self.id, error = %e, "runc delete --force failed");
                }
            }
            Err(e) => tracing::warn!(error = %e, "no runc for cleanup"),
        }
        let rootfs = bundle.join("rootfs");
        if let Some(path) = rootfs.to_str()
            && let Err(e) = containerd_shim::mount::umount_recursive(Some(path), 0)
        {
            tracing::warn!(rootfs = path, error = %e, "unmount rootfs failed");
        }
        Ok(DeleteResponse {
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: MessageField::some(timestamp(SystemTime::now())),
            ..Default::default()
        })
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    /// Required by the trait for the crate's own server, which Baton does not run (server.rs serves both
    /// Task API versions and publishes through its own queue): nothing calls this, and it builds the same
    /// service as server.rs does.
    async fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        self.task_service(&publisher.address)
    }
}
