//! A blocking CRI client (the `k8s-cri` crate's CRI v1 API, `runtime.v1`, over gRPC on containerd's socket): the
//! calls the kubelet makes for a pod, in the order it makes them. CRI v1 is what kubelets speak since
//! Kubernetes 1.26, and both containerds the tests run serve it: Debian 12's 1.6.20 serves v1 beside v1alpha2,
//! and containerd 2.x serves only v1.

use std::path::Path;
use std::time::{Duration, Instant};

use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerStatusRequest, ContainerStatusResponse, CreateContainerRequest,
    ExecSyncRequest, ExecSyncResponse, ImageSpec, ImageStatusRequest, ListPodSandboxRequest,
    PodSandbox, PodSandboxConfig, PodSandboxStatusRequest, PodSandboxStatusResponse,
    RemoveContainerRequest, RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest,
    StopContainerRequest, StopPodSandboxRequest, VersionRequest,
};
use tonic::transport::Channel;

/// Errors from the CRI client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime or the connection to the socket could not be set up.
    #[error("the CRI socket: {0}")]
    Connect(#[from] crate::api::Error),
    /// A call returned an error status.
    #[error("CRI {call} {target}: {}", status.message())]
    Rpc {
        /// The call.
        call: &'static str,
        /// The pod, container or image it was about.
        target: String,
        /// The runtime's answer.
        status: tonic::Status,
    },
    /// Something did not become ready in time.
    #[error("{what} not within {within:?}: {last}")]
    NotReady {
        /// What was waited for.
        what: String,
        /// The deadline.
        within: Duration,
        /// The last error seen.
        last: String,
    },
}

impl Error {
    /// The runtime's message (the status message of a failed call), or the whole error text.
    pub fn message(&self) -> String {
        match self {
            Self::Rpc { status, .. } => status.message().to_string(),
            other => other.to_string(),
        }
    }
}

/// A CRI client bound to one socket, blocking on a runtime of its own.
pub struct CriClient {
    runtime: tokio::runtime::Runtime,
    channel: Channel,
}

fn rpc(call: &'static str, target: &str) -> impl FnOnce(tonic::Status) -> Error {
    let target = target.to_string();
    move |status| Error::Rpc {
        call,
        target,
        status,
    }
}

impl CriClient {
    /// Connects to the CRI service on `socket` (containerd's gRPC socket).
    pub fn connect(socket: &Path) -> Result<Self, Error> {
        let (runtime, channel) = crate::api::blocking_channel(socket)?;
        Ok(Self { runtime, channel })
    }

    fn runtime_service(&self) -> RuntimeServiceClient<Channel> {
        RuntimeServiceClient::new(self.channel.clone())
    }

    fn image_service(&self) -> ImageServiceClient<Channel> {
        ImageServiceClient::new(self.channel.clone())
    }

    /// Waits until the runtime service answers `Version` (the CRI plugin starts after containerd's socket).
    pub fn wait_ready(&self, within: Duration) -> Result<String, Error> {
        self.poll(within, "the CRI runtime service answering Version", || {
            let reply = self
                .runtime
                .block_on(self.runtime_service().version(VersionRequest::default()))
                .map_err(rpc("Version", ""))?;
            let reply = reply.into_inner();
            Ok(Some(format!(
                "{} {} (CRI {})",
                reply.runtime_name, reply.runtime_version, reply.runtime_api_version
            )))
        })
    }

    /// Waits until the image service knows `image` (an image imported with ctr reaches CRI's cache
    /// through an event).
    pub fn wait_image(&self, image: &str, within: Duration) -> Result<(), Error> {
        self.poll(within, &format!("image {image} known to CRI"), || {
            let request = ImageStatusRequest {
                image: Some(ImageSpec {
                    image: image.to_string(),
                    ..Default::default()
                }),
                verbose: false,
            };
            let reply = self
                .runtime
                .block_on(self.image_service().image_status(request))
                .map_err(rpc("ImageStatus", image))?;
            Ok(reply.into_inner().image.map(|_| ()))
        })
    }

    /// Calls `attempt` until it returns `Ok(Some(_))` or `within` passes (the last error is reported).
    fn poll<T>(
        &self,
        within: Duration,
        what: &str,
        mut attempt: impl FnMut() -> Result<Option<T>, Error>,
    ) -> Result<T, Error> {
        let deadline = Instant::now() + within;
        let mut last;
        loop {
            match attempt() {
                Ok(Some(value)) => return Ok(value),
                Ok(None) => last = "not yet".into(),
                Err(error) => last = error.to_string(),
            }
            if Instant::now() >= deadline {
                return Err(Error::NotReady {
                    what: what.to_string(),
                    within,
                    last,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// RunPodSandbox with runtime handler `handler`; returns the sandbox id.
    pub fn run_pod_sandbox(
        &self,
        config: &PodSandboxConfig,
        handler: &str,
    ) -> Result<String, Error> {
        let name = config
            .metadata
            .as_ref()
            .map(|m| m.name.clone())
            .unwrap_or_default();
        let request = RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.to_string(),
        };
        let reply = self
            .runtime
            .block_on(self.runtime_service().run_pod_sandbox(request))
            .map_err(rpc("RunPodSandbox", &name))?;
        Ok(reply.into_inner().pod_sandbox_id)
    }

    /// CreateContainer in sandbox `pod` (created from `sandbox`); returns the container id.
    pub fn create_container(
        &self,
        pod: &str,
        config: &ContainerConfig,
        sandbox: &PodSandboxConfig,
    ) -> Result<String, Error> {
        let request = CreateContainerRequest {
            pod_sandbox_id: pod.to_string(),
            config: Some(config.clone()),
            sandbox_config: Some(sandbox.clone()),
        };
        let reply = self
            .runtime
            .block_on(self.runtime_service().create_container(request))
            .map_err(rpc("CreateContainer", pod))?;
        Ok(reply.into_inner().container_id)
    }

    /// StartContainer.
    pub fn start_container(&self, id: &str) -> Result<(), Error> {
        let request = StartContainerRequest {
            container_id: id.to_string(),
        };
        self.runtime
            .block_on(self.runtime_service().start_container(request))
            .map_err(rpc("StartContainer", id))?;
        Ok(())
    }

    /// StopContainer, giving it `grace` (whole seconds) after SIGTERM before SIGKILL.
    pub fn stop_container(&self, id: &str, grace: Duration) -> Result<(), Error> {
        let request = StopContainerRequest {
            container_id: id.to_string(),
            timeout: i64::try_from(grace.as_secs()).unwrap_or(i64::MAX),
        };
        self.runtime
            .block_on(self.runtime_service().stop_container(request))
            .map_err(rpc("StopContainer", id))?;
        Ok(())
    }

    /// RemoveContainer.
    pub fn remove_container(&self, id: &str) -> Result<(), Error> {
        let request = RemoveContainerRequest {
            container_id: id.to_string(),
        };
        self.runtime
            .block_on(self.runtime_service().remove_container(request))
            .map_err(rpc("RemoveContainer", id))?;
        Ok(())
    }

    /// ExecSync of `cmd` in container `id`, at most `timeout` (whole seconds).
    pub fn exec_sync(
        &self,
        id: &str,
        cmd: &[&str],
        timeout: Duration,
    ) -> Result<ExecSyncResponse, Error> {
        let request = ExecSyncRequest {
            container_id: id.to_string(),
            cmd: cmd.iter().map(|arg| arg.to_string()).collect(),
            timeout: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        };
        let reply = self
            .runtime
            .block_on(self.runtime_service().exec_sync(request))
            .map_err(rpc("ExecSync", id))?;
        Ok(reply.into_inner())
    }

    /// PodSandboxStatus (verbose: `info` holds containerd's JSON, with the pid).
    pub fn pod_sandbox_status(&self, id: &str) -> Result<PodSandboxStatusResponse, Error> {
        let request = PodSandboxStatusRequest {
            pod_sandbox_id: id.to_string(),
            verbose: true,
        };
        let reply = self
            .runtime
            .block_on(self.runtime_service().pod_sandbox_status(request))
            .map_err(rpc("PodSandboxStatus", id))?;
        Ok(reply.into_inner())
    }

    /// ContainerStatus (verbose: `info` holds containerd's JSON, with the pid).
    pub fn container_status(&self, id: &str) -> Result<ContainerStatusResponse, Error> {
        let request = ContainerStatusRequest {
            container_id: id.to_string(),
            verbose: true,
        };
        let reply = self
            .runtime
            .block_on(self.runtime_service().container_status(request))
            .map_err(rpc("ContainerStatus", id))?;
        Ok(reply.into_inner())
    }

    /// Every pod sandbox CRI knows.
    pub fn list_pod_sandboxes(&self) -> Result<Vec<PodSandbox>, Error> {
        let reply = self
            .runtime
            .block_on(
                self.runtime_service()
                    .list_pod_sandbox(ListPodSandboxRequest::default()),
            )
            .map_err(rpc("ListPodSandbox", ""))?;
        Ok(reply.into_inner().items)
    }

    /// StopPodSandbox (stops its containers too).
    pub fn stop_pod_sandbox(&self, id: &str) -> Result<(), Error> {
        let request = StopPodSandboxRequest {
            pod_sandbox_id: id.to_string(),
        };
        self.runtime
            .block_on(self.runtime_service().stop_pod_sandbox(request))
            .map_err(rpc("StopPodSandbox", id))?;
        Ok(())
    }

    /// RemovePodSandbox (removes its containers too).
    pub fn remove_pod_sandbox(&self, id: &str) -> Result<(), Error> {
        let request = RemovePodSandboxRequest {
            pod_sandbox_id: id.to_string(),
        };
        self.runtime
            .block_on(self.runtime_service().remove_pod_sandbox(request))
            .map_err(rpc("RemovePodSandbox", id))?;
        Ok(())
    }
}

/// The `pid` in the verbose `info` of a sandbox or container status (containerd's JSON under key `info`).
pub fn pid_from_info(info: &std::collections::HashMap<String, String>) -> Option<i32> {
    let json: serde_json::Value = serde_json::from_str(info.get("info")?).ok()?;
    i32::try_from(json["pid"].as_i64()?).ok()
}
