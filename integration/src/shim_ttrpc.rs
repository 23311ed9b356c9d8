//! Asking a shim directly over its ttrpc socket, as containerd does, for what containerd 1.6 would hide by
//! converting it (an absent timestamp and the zero time both reach a 1.6 client as 0001-01-01, while containerd
//! 2.x turns an absent one into 1970). Calls go to `containerd.task.v2.Task`, which both Baton's shim and
//! Debian's Go shim serve.

use std::path::Path;
use std::time::Duration;

use containerd_shim_protos::api::{StateRequest, StateResponse};
use containerd_shim_protos::protobuf::Message;
use containerd_shim_protos::ttrpc;

/// The Task service name containerd 1.6 calls.
const TASK_V2: &str = "containerd.task.v2.Task";
/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors talking to a shim.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The bundle has no readable `address` file (the shim never started, or the task is gone).
    #[error("reading the shim address in {path}: {source}")]
    Address {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The call failed (connection, encoding, or the shim's error status).
    #[error("{method} to the shim at {address}: {detail}")]
    Call {
        /// The method.
        method: &'static str,
        /// The shim's address.
        address: String,
        /// What went wrong.
        detail: String,
    },
}

/// The shim serving the task whose bundle is `bundle`, per its `address` file.
pub struct ShimClient {
    address: String,
    namespace: String,
    client: ttrpc::Client,
}

impl ShimClient {
    /// Connects to the shim of the bundle `bundle` (`<state>/io.containerd.runtime.v2.task/<ns>/<id>`).
    pub fn for_bundle(bundle: &Path, namespace: &str) -> Result<Self, Error> {
        let file = bundle.join("address");
        let address = std::fs::read_to_string(&file).map_err(|source| Error::Address {
            path: file.display().to_string(),
            source,
        })?;
        let address = address.trim().to_string();
        let client = ttrpc::Client::connect(&address).map_err(|error| Error::Call {
            method: "connect",
            address: address.clone(),
            detail: error.to_string(),
        })?;
        Ok(Self {
            address,
            namespace: namespace.to_string(),
            client,
        })
    }

    /// The shim's State of task `id` (or exec `exec_id`), as the shim answers it.
    pub fn state(&self, id: &str, exec_id: &str) -> Result<StateResponse, Error> {
        let request = StateRequest {
            id: id.to_string(),
            exec_id: exec_id.to_string(),
            ..Default::default()
        };
        self.call("State", &request)
    }

    fn call<Req: Message, Resp: Message>(
        &self,
        method: &'static str,
        request: &Req,
    ) -> Result<Resp, Error> {
        let failed = |detail: String| Error::Call {
            method,
            address: self.address.clone(),
            detail,
        };
        let payload = request
            .write_to_bytes()
            .map_err(|error| failed(error.to_string()))?;
        let mut namespace = ttrpc::proto::KeyValue::new();
        namespace.key = "containerd-namespace-ttrpc".to_string();
        namespace.value = self.namespace.clone();
        let mut call = ttrpc::Request::new();
        call.service = TASK_V2.to_string();
        call.method = method.to_string();
        call.payload = payload;
        call.timeout_nano = CALL_TIMEOUT.as_nanos() as i64;
        call.metadata = vec![namespace];
        let response = self
            .client
            .request(call)
            .map_err(|error| failed(error.to_string()))?;
        Resp::parse_from_bytes(&response.payload).map_err(|error| failed(error.to_string()))
    }
}
