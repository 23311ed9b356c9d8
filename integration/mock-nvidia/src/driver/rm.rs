//! The resource-manager model behind the mock: per open file its clients and a parent/child object
//! tree, the class rules that decide which parent an object may have, VRAM accounting per GPU, and the
//! frees (of an object's subtree, of a client, of everything a file holds at its release).
//!
//! VRAM capacity, as a real GPU has it: each GPU has `vram_bytes_per_gpu` of video memory, and a
//! video-memory allocation (`NV01_MEMORY_LOCAL_USER`, whichever escape brings it) that does not fit in
//! the free memory of *its* GPU is refused with `NV_ERR_INSUFFICIENT_RESOURCES` and leaves nothing behind;
//! used memory never exceeds capacity. An allocation's GPU is its device's: an `NV01_DEVICE_0` is GPU
//! `deviceId` of its `NV0080_ALLOC_PARAMETERS` (instance 0 when it has none, as `deviceConstruct_IMPL` in
//! open-gpu-kernel-modules src/nvidia/src/kernel/gpu/device.c does), and every object under it (subdevice,
//! memory, ...) is on that GPU. What it does not model: the memory the driver reserves for itself (all of
//! the capacity can be allocated, where a real GPU has less free than its total), page size and alignment
//! rounding, fragmentation, system memory limits (system memory is not accounted as VRAM), and the exact
//! out-of-memory status: no recording has a real allocation refused for lack of memory
//! (/work/shared/gpu/580.159.04 has none), so `NV_ERR_INSUFFICIENT_RESOURCES` is the mock's choice.
//!
//! Requests arrive already decoded ([`AllocRequest`], ...); [`super::escapes`] turns ioctl bytes into
//! them and writes the returned status back at the struct's status offset.

use std::collections::BTreeMap;

use baton_nvidia::{class, status};

use super::classes::{Role, allowed_parents, holds_memory, role_of};
use super::nodes::Node;
use super::state::{ClientState, DriverState, FileState, MappingState, ObjectState, Totals};

/// First client handle the mock hands out when the caller asks for handle 0 (mock-chosen, "MC").
const MOCK_CLIENT_HANDLE_BASE: u32 = 0x4d43_0000;
/// First object handle the mock hands out when the caller asks for handle 0 (mock-chosen, "MO").
const MOCK_OBJECT_HANDLE_BASE: u32 = 0x4d4f_0000;

/// How the mock is configured.
#[derive(Debug, Clone)]
pub struct RmConfig {
    /// Driver version string, e.g. `595.45.04`.
    pub driver_version: String,
    /// Number of GPUs.
    pub gpus: u32,
    /// Video memory per GPU in bytes: the capacity no GPU's allocations may exceed.
    pub vram_bytes_per_gpu: u64,
}

/// A decoded allocation (`RM_ALLOC`, `RM_ALLOC_MEMORY`, `RM_VID_HEAP_CONTROL` alloc).
#[derive(Debug, Clone, Copy)]
pub struct AllocRequest {
    /// `hRoot`: the client (for root classes: the requested client handle, 0 = choose).
    pub root: u32,
    /// `hObjectParent`.
    pub parent: u32,
    /// `hObjectNew` (0 = let the driver choose).
    pub new: u32,
    /// `hClass`.
    pub class: u32,
    /// Bytes of memory requested, when the mock could read it.
    pub bytes: Option<u64>,
    /// For `NV01_DEVICE_0`: the `deviceId` of its `NV0080_ALLOC_PARAMETERS`, when it has params the mock
    /// could read; `None` is device instance 0 (the driver's answer to no params).
    pub device_id: Option<u32>,
}

#[derive(Debug, Clone)]
struct Object {
    class: u32,
    parent: u32,
    bytes: u64,
    size_known: bool,
    /// The GPU (device instance) it is on: its device's; `None` for the objects of no device.
    gpu: Option<u32>,
    /// Allocation order, so listings and frees follow it.
    seq: u64,
}

impl Object {
    /// The GPU whose video memory it holds, with the bytes; `None` when it holds none.
    fn video_memory(&self) -> Option<(u32, u64)> {
        class::is_video_memory(self.class).then_some((self.gpu.unwrap_or(0), self.bytes))
    }
}

#[derive(Debug, Clone, Default)]
struct Client {
    objects: BTreeMap<u32, Object>,
    next_handle: u32,
}

impl Client {
    fn children_of(&self, parent: u32) -> Vec<u32> {
        self.objects
            .iter()
            .filter(|(_, object)| object.parent == parent)
            .map(|(handle, _)| *handle)
            .collect()
    }

    /// Removes `handle` and everything below it; returns the objects removed with their handles.
    fn remove_subtree(&mut self, handle: u32) -> Vec<(u32, Object)> {
        let mut removed = Vec::new();
        let mut pending = vec![handle];
        while let Some(next) = pending.pop() {
            pending.extend(self.children_of(next));
            if let Some(object) = self.objects.remove(&next) {
                removed.push((next, object));
            }
        }
        removed
    }
}

#[derive(Debug, Clone)]
struct OpenFile {
    node: Node,
    pid: u32,
    clients: BTreeMap<u32, Client>,
    client_order: Vec<u32>,
    registered_ctl_fd: Option<i32>,
    attached_gpus: Vec<u32>,
    mappings: Vec<MappingState>,
    uvm_commands: BTreeMap<u32, u64>,
    ioctls: u64,
}

/// The mock resource manager: every open device file and what it holds.
#[derive(Debug)]
pub struct Rm {
    config: RmConfig,
    files: BTreeMap<u64, OpenFile>,
    next_fh: u64,
    next_client: u32,
    next_seq: u64,
    /// Video memory held per GPU (index = device instance), never above `vram_bytes_per_gpu`.
    vram_used: Vec<u64>,
    totals: Totals,
}

impl Rm {
    /// An empty RM for `config`.
    pub fn new(config: RmConfig) -> Self {
        Self {
            files: BTreeMap::new(),
            next_fh: 1,
            next_client: MOCK_CLIENT_HANDLE_BASE,
            next_seq: 0,
            vram_used: vec![0; config.gpus.max(1) as usize],
            config,
            totals: Totals::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RmConfig {
        &self.config
    }

    /// Opens a device file for `pid`; returns the new file handle.
    pub fn open(&mut self, node: Node, pid: u32) -> u64 {
        let fh = self.next_fh;
        self.next_fh += 1;
        self.totals.opens += 1;
        self.files.insert(
            fh,
            OpenFile {
                node,
                pid,
                clients: BTreeMap::new(),
                client_order: Vec::new(),
                registered_ctl_fd: None,
                attached_gpus: Vec::new(),
                mappings: Vec::new(),
                uvm_commands: BTreeMap::new(),
                ioctls: 0,
            },
        );
        fh
    }

    /// The final release of a file: frees every client it holds.
    pub fn release(&mut self, fh: u64) {
        if let Some(file) = self.files.remove(&fh) {
            self.totals.releases += 1;
            for client in file.clients.values() {
                self.give_back(client.objects.values());
                self.totals.frees += client.objects.len() as u64 + 1;
            }
        }
    }

    /// The node an open file stands for.
    pub fn node_of(&self, fh: u64) -> Option<Node> {
        self.files.get(&fh).map(|file| file.node)
    }

    /// Counts an ioctl on `fh`.
    pub fn count_ioctl(&mut self, fh: u64) {
        if let Some(file) = self.files.get_mut(&fh) {
            file.ioctls += 1;
        }
    }

    /// Records a status answered to an RM call (for the failure counter); returns it.
    pub fn answered(&mut self, status_code: u32) -> u32 {
        if status_code != status::NV_OK {
            self.totals.failed_statuses += 1;
        }
        status_code
    }

    fn vram_total(&self) -> u64 {
        self.config
            .vram_bytes_per_gpu
            .saturating_mul(u64::from(self.config.gpus))
    }

    /// Returns the video memory `objects` held to their GPUs.
    fn give_back<'a>(&mut self, objects: impl IntoIterator<Item = &'a Object>) {
        for (gpu, bytes) in objects.into_iter().filter_map(Object::video_memory) {
            if let Some(used) = self.vram_used.get_mut(gpu as usize) {
                *used = used.saturating_sub(bytes);
            }
        }
    }

    /// Which file of `fh`'s owner holds `client`: the client must belong to `fh` itself.
    fn client_mut(&mut self, fh: u64, client: u32) -> Result<&mut Client, u32> {
        self.files
            .get_mut(&fh)
            .and_then(|file| file.clients.get_mut(&client))
            .ok_or(status::NV_ERR_INVALID_CLIENT)
    }

    fn client_exists_anywhere(&self, handle: u32) -> bool {
        self.files
            .values()
            .any(|file| file.clients.contains_key(&handle))
    }

    /// `RM_ALLOC` (and the other allocation escapes): returns the new handle or the failure status.
    pub fn alloc(&mut self, fh: u64, request: AllocRequest) -> Result<u32, u32> {
        if class::is_root(request.class) {
            return self.alloc_client(fh, request.new);
        }
        let Some(parents) = allowed_parents(request.class) else {
            // The real RM checks the client first, then the class.
            self.client_mut(fh, request.root)?;
            return Err(status::NV_ERR_INVALID_CLASS);
        };
        let seq = self.next_seq;
        let bytes = request.bytes.unwrap_or(0);
        let is_video = class::is_video_memory(request.class);
        let client = self
            .files
            .get_mut(&fh)
            .and_then(|file| file.clients.get_mut(&request.root))
            .ok_or(status::NV_ERR_INVALID_CLIENT)?;
        let (parent_role, parent_gpu) = if request.parent == request.root {
            (Role::Client, None)
        } else {
            match client.objects.get(&request.parent) {
                Some(parent) => (role_of(parent.class), parent.gpu),
                None => return Err(status::NV_ERR_INVALID_OBJECT_PARENT),
            }
        };
        if !parents.contains(&parent_role) {
            return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
        }
        let gpu = if request.class == class::NV01_DEVICE_0 {
            // device.c deviceConstruct_IMPL: no params is instance 0; an instance with no GPU behind
            // it fails `gpumgrIsDeviceInstanceValid` with NV_ERR_INVALID_CLASS (no recording covers it).
            let instance = request.device_id.unwrap_or(0);
            if instance >= self.config.gpus {
                return Err(status::NV_ERR_INVALID_CLASS);
            }
            Some(instance)
        } else {
            parent_gpu
        };
        let handle = match request.new {
            0 => next_free_handle(client),
            requested if requested == request.root || client.objects.contains_key(&requested) => {
                return Err(status::NV_ERR_INSERT_DUPLICATE_NAME);
            }
            requested => requested,
        };
        if is_video {
            // Video memory sits under a device (its only parents), so it has a GPU; 0 is a fallback.
            let used = self
                .vram_used
                .get_mut(gpu.unwrap_or(0) as usize)
                .ok_or(status::NV_ERR_INSUFFICIENT_RESOURCES)?;
            if bytes > self.config.vram_bytes_per_gpu.saturating_sub(*used) {
                return Err(status::NV_ERR_INSUFFICIENT_RESOURCES);
            }
            *used += bytes;
        }
        client.objects.insert(
            handle,
            Object {
                class: request.class,
                parent: request.parent,
                bytes,
                // Non-memory objects hold no memory: their 0 bytes are known.
                size_known: request.bytes.is_some() || !holds_memory(request.class),
                gpu,
                seq,
            },
        );
        self.next_seq += 1;
        self.totals.allocs += 1;
        Ok(handle)
    }

    fn alloc_client(&mut self, fh: u64, requested: u32) -> Result<u32, u32> {
        let handle = if requested == 0 {
            while self.client_exists_anywhere(self.next_client) {
                self.next_client = self.next_client.wrapping_add(1);
            }
            // Like RM, never hand the same handle out twice in a row, even after a free.
            let handle = self.next_client;
            self.next_client = self.next_client.wrapping_add(1);
            handle
        } else if self.client_exists_anywhere(requested) {
            return Err(status::NV_ERR_INSERT_DUPLICATE_NAME);
        } else {
            requested
        };
        let file = self
            .files
            .get_mut(&fh)
            .ok_or(status::NV_ERR_INVALID_CLIENT)?;
        file.clients.insert(
            handle,
            Client {
                objects: BTreeMap::new(),
                next_handle: MOCK_OBJECT_HANDLE_BASE,
            },
        );
        file.client_order.push(handle);
        self.totals.allocs += 1;
        Ok(handle)
    }

    /// `RM_FREE`: frees `object` and its subtree, or the whole client when `object == client`; the
    /// `RM_MAP_MEMORY` records of what it freed go with it. An explicit free frees whatever other fds or
    /// mappings hold the file (a forked child's, say): the H200 freed the GPU at the parent's park while
    /// its forked child still held the files (/work/shared/gpu/580.159.04/README.md, "Forked children").
    pub fn free(&mut self, fh: u64, client: u32, object: u32) -> u32 {
        let found = self.client_mut(fh, client).map(|_| ());
        if let Err(code) = found {
            return code;
        }
        if object == client {
            let Some(file) = self.files.get_mut(&fh) else {
                return status::NV_ERR_INVALID_CLIENT;
            };
            file.client_order.retain(|handle| *handle != client);
            file.mappings.retain(|mapping| mapping.client != client);
            if let Some(removed) = file.clients.remove(&client) {
                self.give_back(removed.objects.values());
                self.totals.frees += removed.objects.len() as u64 + 1;
            }
            return status::NV_OK;
        }
        let Ok(owner) = self.client_mut(fh, client) else {
            return status::NV_ERR_INVALID_CLIENT;
        };
        if !owner.objects.contains_key(&object) {
            return status::NV_ERR_INVALID_OBJECT_HANDLE;
        }
        let removed = owner.remove_subtree(object);
        self.give_back(removed.iter().map(|(_, object)| object));
        self.totals.frees += removed.len() as u64;
        if let Some(file) = self.files.get_mut(&fh) {
            file.mappings.retain(|m| {
                m.client != client || !removed.iter().any(|(handle, _)| *handle == m.memory)
            });
        }
        status::NV_OK
    }

    /// Checks that `object` (or the client itself) exists under `client` of file `fh`.
    pub fn check_object(&mut self, fh: u64, client: u32, object: u32) -> u32 {
        match self.client_mut(fh, client) {
            Err(code) => code,
            Ok(_) if object == client => status::NV_OK,
            Ok(owner) if owner.objects.contains_key(&object) => status::NV_OK,
            Ok(_) => status::NV_ERR_INVALID_OBJECT_HANDLE,
        }
    }

    /// The class of `object` under `client` of file `fh`; `None` for the client itself or an unknown object.
    pub fn class_of(&self, fh: u64, client: u32, object: u32) -> Option<u32> {
        self.files
            .get(&fh)
            .and_then(|file| file.clients.get(&client))
            .and_then(|c| c.objects.get(&object))
            .map(|o| o.class)
    }

    /// Video memory `(total, used)` of all GPUs together, in bytes.
    pub fn vram(&self) -> (u64, u64) {
        (self.vram_total(), self.vram_used.iter().sum())
    }

    /// The GPU `object` under `client` of file `fh` is on; `None` for the client itself, an unknown
    /// object, or one under no device.
    pub fn gpu_of(&self, fh: u64, client: u32, object: u32) -> Option<u32> {
        self.files
            .get(&fh)
            .and_then(|file| file.clients.get(&client))
            .and_then(|c| c.objects.get(&object))
            .and_then(|o| o.gpu)
    }

    /// Video memory `(total, used)` of GPU `gpu`, in bytes (`(0, 0)` for a GPU the mock does not have).
    pub fn vram_of_gpu(&self, gpu: u32) -> (u64, u64) {
        match self.vram_used.get(gpu as usize) {
            Some(used) => (self.config.vram_bytes_per_gpu, *used),
            None => (0, 0),
        }
    }

    /// Counts an `RM_CONTROL` (the caller decides the status).
    pub fn count_control(&mut self) {
        self.totals.controls += 1;
    }

    /// `REGISTER_FD` on `fh`.
    pub fn register_fd(&mut self, fh: u64, ctl_fd: i32) {
        if let Some(file) = self.files.get_mut(&fh) {
            file.registered_ctl_fd = Some(ctl_fd);
        }
    }

    /// `ATTACH_GPUS_TO_FD` on `fh`.
    pub fn attach_gpus(&mut self, fh: u64, gpu_ids: Vec<u32>) {
        if let Some(file) = self.files.get_mut(&fh) {
            file.attached_gpus = gpu_ids;
        }
    }

    /// `RM_MAP_MEMORY`: records the mapping when client, device and memory exist; returns the status.
    pub fn map_memory(&mut self, fh: u64, mapping: MappingState) -> u32 {
        for handle in [mapping.device, mapping.memory] {
            let code = self.check_object(fh, mapping.client, handle);
            if code != status::NV_OK {
                return code;
            }
        }
        if let Some(file) = self.files.get_mut(&fh) {
            file.mappings.push(mapping);
        }
        status::NV_OK
    }

    /// `RM_UNMAP_MEMORY`: drops one recorded mapping of `memory`; returns the status.
    pub fn unmap_memory(&mut self, fh: u64, client: u32, device: u32, memory: u32) -> u32 {
        let code = self.check_object(fh, client, device);
        if code != status::NV_OK {
            return code;
        }
        let Some(file) = self.files.get_mut(&fh) else {
            return status::NV_ERR_INVALID_CLIENT;
        };
        let found = file
            .mappings
            .iter()
            .position(|m| m.client == client && m.device == device && m.memory == memory);
        match found {
            Some(index) => {
                file.mappings.remove(index);
                status::NV_OK
            }
            None => status::NV_ERR_INVALID_OBJECT_HANDLE,
        }
    }

    /// A UVM command on `fh` (no data crosses FUSE for them): counted.
    pub fn uvm_command(&mut self, fh: u64, cmd: u32) {
        if let Some(file) = self.files.get_mut(&fh) {
            *file.uvm_commands.entry(cmd).or_default() += 1;
        }
        self.totals.uvm_commands += 1;
    }

    /// A snapshot of everything, in the shape of `state.json`.
    pub fn snapshot(&self) -> DriverState {
        DriverState {
            driver_version: self.config.driver_version.clone(),
            gpus: self.config.gpus,
            vram_bytes: self.vram_total(),
            vram_used_bytes: self.vram_used.iter().sum(),
            vram_bytes_per_gpu: self.config.vram_bytes_per_gpu,
            vram_used_bytes_per_gpu: self.vram_used.clone(),
            files: self
                .files
                .iter()
                .map(|(fh, file)| file_state(*fh, file))
                .collect(),
            totals: self.totals.clone(),
        }
    }

    /// [`Rm::snapshot`] as pretty JSON.
    pub fn state_json(&self) -> String {
        // Serializing plain structs of numbers and strings cannot fail; fall back to an empty object.
        let mut text = serde_json::to_string_pretty(&self.snapshot()).unwrap_or_default();
        text.push('\n');
        text
    }
}

fn next_free_handle(client: &mut Client) -> u32 {
    while client.objects.contains_key(&client.next_handle) {
        client.next_handle = client.next_handle.wrapping_add(1);
    }
    let handle = client.next_handle;
    client.next_handle = client.next_handle.wrapping_add(1);
    handle
}

fn file_state(fh: u64, file: &OpenFile) -> FileState {
    let clients = file
        .client_order
        .iter()
        .filter_map(|handle| file.clients.get(handle).map(|c| client_state(*handle, c)))
        .collect();
    FileState {
        fh,
        node: file.node.name(),
        pid: file.pid,
        clients,
        registered_ctl_fd: file.registered_ctl_fd,
        attached_gpus: file.attached_gpus.clone(),
        mappings: file.mappings.clone(),
        uvm_commands: file
            .uvm_commands
            .iter()
            .map(|(cmd, count)| (format!("{cmd:#x}"), *count))
            .collect(),
        ioctls: file.ioctls,
    }
}

fn client_state(handle: u32, client: &Client) -> ClientState {
    let mut objects: Vec<(&u32, &Object)> = client.objects.iter().collect();
    objects.sort_by_key(|(_, object)| object.seq);
    ClientState {
        handle,
        objects: objects
            .into_iter()
            .map(|(handle, object)| ObjectState {
                handle: *handle,
                class: object.class,
                class_name: class::name(object.class).map(str::to_owned),
                parent: object.parent,
                bytes: object.bytes,
                size_known: object.size_known,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn rm() -> Rm {
        Rm::new(RmConfig {
            driver_version: "595.45.04".to_owned(),
            gpus: 1,
            vram_bytes_per_gpu: 2 * GIB,
        })
    }

    fn alloc(
        rm: &mut Rm,
        fh: u64,
        ids: [u32; 3],
        class: u32,
        bytes: Option<u64>,
    ) -> Result<u32, u32> {
        rm.alloc(
            fh,
            AllocRequest {
                root: ids[0],
                parent: ids[1],
                new: ids[2],
                class,
                bytes,
                device_id: None,
            },
        )
    }

    /// A client with device 1, subdevice 2, channel group 3, channel 4, compute 5, memory 6 (1 GiB).
    fn tree(rm: &mut Rm, fh: u64) -> u32 {
        let client = alloc(rm, fh, [0, 0, 0], class::NV01_ROOT_CLIENT, None).unwrap();
        for (parent, new, class) in [
            (client, 1, class::NV01_DEVICE_0),
            (1, 2, class::NV20_SUBDEVICE_0),
            (1, 3, class::KEPLER_CHANNEL_GROUP_A),
            (3, 4, class::HOPPER_CHANNEL_GPFIFO_A),
            (4, 5, class::HOPPER_COMPUTE_A),
        ] {
            assert_eq!(alloc(rm, fh, [client, parent, new], class, None), Ok(new));
        }
        let memory = alloc(
            rm,
            fh,
            [client, 1, 6],
            class::NV01_MEMORY_LOCAL_USER,
            Some(GIB),
        );
        assert_eq!(memory, Ok(6));
        client
    }

    #[test]
    fn builds_a_tree_and_accounts_vram() {
        let mut rm = rm();
        let fh = rm.open(Node::Ctl, 1);
        let client = tree(&mut rm, fh);
        let state = rm.snapshot();
        assert_eq!(state.vram_used_bytes, GIB);
        assert_eq!(state.objects().count(), 6);
        assert_eq!(state.object(client, 5).map(|o| o.parent), Some(4));
        assert_eq!(
            state.object(client, 6).map(|o| (o.bytes, o.size_known)),
            Some((GIB, true))
        );
    }

    #[test]
    fn refuses_wrong_parent_unknown_class_and_foreign_client() {
        let mut rm = rm();
        let fh = rm.open(Node::Ctl, 1);
        let other = rm.open(Node::Ctl, 2);
        let client = tree(&mut rm, fh);
        // Compute directly under the device, subdevice under the client, parent that does not exist.
        let wrong = status::NV_ERR_INVALID_OBJECT_PARENT;
        assert_eq!(
            alloc(&mut rm, fh, [client, 1, 9], class::HOPPER_COMPUTE_A, None),
            Err(wrong)
        );
        assert_eq!(
            alloc(
                &mut rm,
                fh,
                [client, client, 9],
                class::NV20_SUBDEVICE_0,
                None
            ),
            Err(wrong)
        );
        assert_eq!(
            alloc(&mut rm, fh, [client, 77, 9], class::NV20_SUBDEVICE_0, None),
            Err(wrong)
        );
        let unknown = (0x1234u32..).find(|c| class::name(*c).is_none()).unwrap();
        assert_eq!(
            alloc(&mut rm, fh, [client, 1, 9], unknown, None),
            Err(status::NV_ERR_INVALID_CLASS)
        );
        // The client belongs to the first file only.
        assert_eq!(
            alloc(
                &mut rm,
                other,
                [client, client, 9],
                class::NV01_DEVICE_0,
                None
            ),
            Err(status::NV_ERR_INVALID_CLIENT)
        );
        assert_eq!(
            alloc(&mut rm, fh, [client, 1, 2], class::NV20_SUBDEVICE_0, None),
            Err(status::NV_ERR_INSERT_DUPLICATE_NAME)
        );
        assert_eq!(
            alloc(
                &mut rm,
                fh,
                [client, 1, 0],
                class::NV01_MEMORY_LOCAL_USER,
                Some(2 * GIB)
            ),
            Err(status::NV_ERR_INSUFFICIENT_RESOURCES)
        );
        assert_eq!(
            rm.snapshot().objects().count(),
            6,
            "failed allocs leave nothing"
        );
    }

    #[test]
    fn frees_subtrees_clients_and_files() {
        let mut rm = rm();
        let fh = rm.open(Node::Ctl, 1);
        let client = tree(&mut rm, fh);
        assert_eq!(rm.free(fh, client, 3), status::NV_OK);
        let state = rm.snapshot();
        assert!(state.object(client, 4).is_none() && state.object(client, 5).is_none());
        assert!(state.object(client, 6).is_some());
        assert_eq!(rm.free(fh, client, 3), status::NV_ERR_INVALID_OBJECT_HANDLE);
        assert_eq!(rm.free(fh, client, client), status::NV_OK);
        assert_eq!(rm.snapshot().clients().count(), 0);
        assert_eq!(rm.snapshot().vram_used_bytes, 0);
        assert_eq!(rm.free(fh, client, client), status::NV_ERR_INVALID_CLIENT);

        tree(&mut rm, fh);
        rm.release(fh);
        let state = rm.snapshot();
        assert!(state.files.is_empty());
        assert_eq!(state.vram_used_bytes, 0);
        assert_eq!(state.totals.allocs, state.totals.frees);
    }

    #[test]
    fn picks_client_and_object_handles_when_asked_for_zero() {
        let mut rm = rm();
        let fh = rm.open(Node::Ctl, 1);
        let first = alloc(&mut rm, fh, [0, 0, 0], class::NV01_ROOT_CLIENT, None).unwrap();
        let second = alloc(&mut rm, fh, [0, 0, 0], class::NV01_ROOT_CLIENT, None).unwrap();
        assert_ne!(first, second);
        assert_eq!(
            alloc(&mut rm, fh, [0, 0, first], class::NV01_ROOT_CLIENT, None),
            Err(status::NV_ERR_INSERT_DUPLICATE_NAME)
        );
        let device = alloc(&mut rm, fh, [first, first, 0], class::NV01_DEVICE_0, None).unwrap();
        assert!(device != 0 && device != first);
    }

    const MIB: u64 = 1 << 20;

    /// An RM of `gpus` GPUs of `capacity` bytes each.
    fn rm_of(gpus: u32, capacity: u64) -> Rm {
        Rm::new(RmConfig {
            driver_version: "595.45.04".to_owned(),
            gpus,
            vram_bytes_per_gpu: capacity,
        })
    }

    /// A client on `fh` with device 1 on GPU `gpu` (`deviceId`) and subdevice 2 under it.
    fn device_on(rm: &mut Rm, fh: u64, gpu: u32) -> u32 {
        let client = alloc(rm, fh, [0, 0, 0], class::NV01_ROOT_CLIENT, None).unwrap();
        let device = rm.alloc(
            fh,
            AllocRequest {
                root: client,
                parent: client,
                new: 1,
                class: class::NV01_DEVICE_0,
                bytes: None,
                device_id: Some(gpu),
            },
        );
        assert_eq!(device, Ok(1));
        assert_eq!(
            alloc(rm, fh, [client, 1, 2], class::NV20_SUBDEVICE_0, None),
            Ok(2)
        );
        client
    }

    /// Video memory of `bytes` under `parent` (device 1 or subdevice 2), the driver picking the handle.
    fn vram(rm: &mut Rm, fh: u64, client: u32, parent: u32, bytes: u64) -> Result<u32, u32> {
        alloc(
            rm,
            fh,
            [client, parent, 0],
            class::NV01_MEMORY_LOCAL_USER,
            Some(bytes),
        )
    }

    /// Used memory per GPU never above capacity, and equal to what the live video-memory objects hold.
    fn assert_within_capacity(rm: &Rm) {
        let state = rm.snapshot();
        for (gpu, used) in state.vram_used_bytes_per_gpu.iter().enumerate() {
            assert!(
                *used <= state.vram_bytes_per_gpu,
                "GPU {gpu}: {used} > {}",
                state.vram_bytes_per_gpu
            );
        }
        let held: u64 = state
            .objects()
            .filter(|o| class::is_video_memory(o.class))
            .map(|o| o.bytes)
            .sum();
        assert_eq!(state.vram_used_bytes, held);
        assert!(state.vram_used_bytes <= state.vram_bytes);
    }

    #[test]
    fn default_capacity_is_the_h200s_143771_mib() {
        let options = super::super::MountOptions::new("/nonexistent");
        assert_eq!(options.vram_mib, 143_771);
        assert_eq!(options.vram_bytes(), 143_771 * MIB);
        assert_eq!(options.gpus, 1);
    }

    #[test]
    fn allocations_fit_up_to_capacity_and_one_past_it_is_refused() {
        let mut rm = rm_of(1, 2 * GIB);
        let fh = rm.open(Node::Ctl, 1);
        let client = device_on(&mut rm, fh, 0);
        let first = vram(&mut rm, fh, client, 1, GIB).unwrap();
        let second = vram(&mut rm, fh, client, 2, GIB - MIB).unwrap();
        assert_eq!(rm.vram_of_gpu(0), (2 * GIB, 2 * GIB - MIB));
        // Exactly the rest fits: the GPU is full.
        let last = vram(&mut rm, fh, client, 1, MIB).unwrap();
        assert_eq!(rm.vram_of_gpu(0), (2 * GIB, 2 * GIB));
        assert_within_capacity(&rm);
        // One byte more does not, whichever parent or escape form; nothing is left behind.
        let objects = rm.snapshot().objects().count();
        for parent in [1, 2] {
            assert_eq!(
                vram(&mut rm, fh, client, parent, 1),
                Err(status::NV_ERR_INSUFFICIENT_RESOURCES)
            );
        }
        assert_eq!(rm.snapshot().objects().count(), objects);
        assert_eq!(rm.vram_of_gpu(0), (2 * GIB, 2 * GIB));
        // Freeing makes room again, for as much as was freed and no more.
        assert_eq!(rm.free(fh, client, last), status::NV_OK);
        assert_eq!(
            vram(&mut rm, fh, client, 1, MIB + 1),
            Err(status::NV_ERR_INSUFFICIENT_RESOURCES)
        );
        assert!(vram(&mut rm, fh, client, 1, MIB).is_ok());
        assert_eq!(rm.free(fh, client, first), status::NV_OK);
        assert_eq!(rm.free(fh, client, second), status::NV_OK);
        assert_eq!(rm.vram_of_gpu(0), (2 * GIB, MIB));
        // More than the whole GPU never fits, even empty.
        assert_eq!(rm.free(fh, client, client), status::NV_OK);
        let client = device_on(&mut rm, fh, 0);
        assert_eq!(
            vram(&mut rm, fh, client, 1, 2 * GIB + 1),
            Err(status::NV_ERR_INSUFFICIENT_RESOURCES)
        );
        assert!(vram(&mut rm, fh, client, 1, 2 * GIB).is_ok());
        // The file's release gives it all back.
        rm.release(fh);
        assert_eq!(rm.vram_of_gpu(0), (2 * GIB, 0));
        assert_within_capacity(&rm);
    }

    #[test]
    fn capacity_is_per_gpu() {
        let mut rm = rm_of(2, GIB);
        let fh = rm.open(Node::Ctl, 1);
        let on_0 = device_on(&mut rm, fh, 0);
        let on_1 = device_on(&mut rm, fh, 1);
        assert!(vram(&mut rm, fh, on_0, 2, GIB).is_ok());
        // GPU 0 is full while GPU 1 is empty: the 1 GiB free in all does not help GPU 0.
        assert_eq!(
            vram(&mut rm, fh, on_0, 1, 1),
            Err(status::NV_ERR_INSUFFICIENT_RESOURCES)
        );
        assert_eq!(
            vram(&mut rm, fh, on_1, 1, GIB + 1),
            Err(status::NV_ERR_INSUFFICIENT_RESOURCES)
        );
        let on_gpu_1 = vram(&mut rm, fh, on_1, 2, GIB).unwrap();
        let state = rm.snapshot();
        assert_eq!(state.vram_used_bytes_per_gpu, vec![GIB, GIB]);
        assert_eq!(
            (state.vram_bytes, state.vram_used_bytes),
            (2 * GIB, 2 * GIB)
        );
        // Freeing on GPU 1 makes room on GPU 1 only.
        assert_eq!(rm.free(fh, on_1, on_gpu_1), status::NV_OK);
        assert_eq!(
            vram(&mut rm, fh, on_0, 1, 1),
            Err(status::NV_ERR_INSUFFICIENT_RESOURCES)
        );
        assert_eq!(rm.vram_of_gpu(1), (GIB, 0));
        assert_within_capacity(&rm);
        // A device with no params is instance 0; an instance with no GPU is refused as the driver does.
        let other = alloc(&mut rm, fh, [0, 0, 0], class::NV01_ROOT_CLIENT, None).unwrap();
        assert_eq!(
            alloc(&mut rm, fh, [other, other, 1], class::NV01_DEVICE_0, None),
            Ok(1)
        );
        assert_eq!(
            vram(&mut rm, fh, other, 1, 1),
            Err(status::NV_ERR_INSUFFICIENT_RESOURCES)
        );
        let beyond = rm.alloc(
            fh,
            AllocRequest {
                root: other,
                parent: other,
                new: 9,
                class: class::NV01_DEVICE_0,
                bytes: None,
                device_id: Some(2),
            },
        );
        assert_eq!(beyond, Err(status::NV_ERR_INVALID_CLASS));
        assert_eq!(rm.gpu_of(fh, on_1, 2), Some(1));
    }

    #[test]
    fn freeing_system_memory_does_not_free_video_memory() {
        let mut rm = rm_of(1, GIB);
        let fh = rm.open(Node::Ctl, 1);
        let client = device_on(&mut rm, fh, 0);
        assert!(vram(&mut rm, fh, client, 1, GIB).is_ok());
        let system = alloc(
            &mut rm,
            fh,
            [client, 1, 0],
            class::NV01_MEMORY_SYSTEM,
            Some(GIB),
        )
        .unwrap();
        assert_eq!(rm.free(fh, client, system), status::NV_OK);
        let other = rm.open(Node::Ctl, 2);
        let second = device_on(&mut rm, other, 0);
        assert_eq!(
            vram(&mut rm, other, second, 1, 1),
            Err(status::NV_ERR_INSUFFICIENT_RESOURCES)
        );
        assert_eq!(rm.vram_of_gpu(0), (GIB, GIB));
        assert_within_capacity(&rm);
    }

    /// Many clients allocating and freeing in a mixed order: used memory never passes capacity, and every
    /// refusal is one that would not have fit.
    #[test]
    fn used_memory_never_exceeds_capacity() {
        let capacity = 64 * MIB;
        let mut rm = rm_of(2, capacity);
        let fh = rm.open(Node::Ctl, 1);
        let clients = [device_on(&mut rm, fh, 0), device_on(&mut rm, fh, 1)];
        let mut live: Vec<(usize, u32, u64)> = Vec::new();
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let (mut refused, mut granted) = (0, 0);
        for step in 0..2000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let gpu = (seed % 2) as usize;
            if step % 3 == 2 && !live.is_empty() {
                let (gpu, handle, _) = live.swap_remove((seed as usize / 2) % live.len());
                assert_eq!(rm.free(fh, clients[gpu], handle), status::NV_OK);
            } else {
                let bytes = (seed >> 8) % (24 * MIB) + 1;
                let used_before = rm.vram_of_gpu(gpu as u32).1;
                match vram(&mut rm, fh, clients[gpu], 1 + (seed % 2) as u32, bytes) {
                    Ok(handle) => {
                        assert!(used_before + bytes <= capacity, "step {step}");
                        live.push((gpu, handle, bytes));
                        granted += 1;
                    }
                    Err(code) => {
                        assert_eq!(code, status::NV_ERR_INSUFFICIENT_RESOURCES);
                        assert!(used_before + bytes > capacity, "step {step}: it fitted");
                        refused += 1;
                    }
                }
            }
            for g in 0..2 {
                let expected: u64 = live.iter().filter(|l| l.0 == g).map(|l| l.2).sum();
                assert_eq!(
                    rm.vram_of_gpu(g as u32),
                    (capacity, expected),
                    "step {step}"
                );
            }
            assert_within_capacity(&rm);
        }
        assert!(
            refused > 100 && granted > 100,
            "{refused} refused, {granted} granted"
        );
    }
}
