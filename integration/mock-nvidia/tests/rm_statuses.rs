//! Single NVIDIA calls against the mock through a real FUSE mount: status codes written into the params'
//! status field, the parent/child tree and its frees, freeing at the file's final release, mmap of the
//! device file, and `IOCTL_XFER_CMD` whose params the mock follows into the caller's memory.

mod common;

use std::os::fd::AsFd;

use baton_mock_nvidia::driver::{DriverState, MockDriver, MountOptions};
use baton_mock_nvidia::workload::calls::{self, AllocForm};
use baton_mock_nvidia::workload::nvfile::NvFile;
use baton_nvidia::layout::{DriverVersion, Layout};
use baton_nvidia::params::{rm_alloc, xfer};
use baton_nvidia::{class, ctrl, escape, status};
use common::{Mock, skip};

const VERSION: &str = "595.45.04";

fn layout() -> Layout {
    Layout::for_version(DriverVersion::parse(VERSION).expect("valid version"))
}

/// Allocates with NVOS21 and returns (status, handle).
fn alloc(ctl: &NvFile, ids: [u32; 3], class_id: u32) -> (u32, u32) {
    let done = calls::rm_alloc(ctl, &layout(), AllocForm::Nvos21, ids, class_id, None)
        .expect("RM_ALLOC ioctl");
    (done.status, done.handle)
}

fn new_client(ctl: &NvFile) -> u32 {
    let done = calls::rm_alloc(
        ctl,
        &layout(),
        AllocForm::Nvos64,
        [0, 0, 0],
        class::NV01_ROOT_CLIENT,
        None,
    )
    .expect("RM_ALLOC ioctl");
    assert_eq!(done.status, status::NV_OK);
    assert_ne!(done.handle, 0, "the driver picks the client handle");
    done.handle
}

/// Client -> device 1 -> channel group 3 -> channel 4 -> compute 5.
fn channel_tree(ctl: &NvFile) -> u32 {
    let client = new_client(ctl);
    for (parent, new, class_id) in [
        (client, 1, class::NV01_DEVICE_0),
        (1, 3, class::KEPLER_CHANNEL_GROUP_A),
        (3, 4, class::HOPPER_CHANNEL_GPFIFO_A),
        (4, 5, class::HOPPER_COMPUTE_A),
    ] {
        assert_eq!(
            alloc(ctl, [client, parent, new], class_id),
            (status::NV_OK, new)
        );
    }
    client
}

#[test]
fn errors_come_back_in_the_status_field() {
    if skip("errors_come_back_in_the_status_field") {
        return;
    }
    let mock = Mock::mount(VERSION, 1024);
    let ctl = NvFile::open(&mock.dir().join("nvidiactl")).unwrap();
    let client = channel_tree(&ctl);
    // Compute must sit under a channel, not a device.
    let (code, _) = alloc(&ctl, [client, 1, 9], class::HOPPER_COMPUTE_A);
    assert_eq!(code, status::NV_ERR_INVALID_OBJECT_PARENT);
    // A parent handle that does not exist.
    let (code, _) = alloc(&ctl, [client, 0x77, 9], class::NV20_SUBDEVICE_0);
    assert_eq!(code, status::NV_ERR_INVALID_OBJECT_PARENT);
    let unknown = (0x1234u32..).find(|c| class::name(*c).is_none()).unwrap();
    let (code, _) = alloc(&ctl, [client, 1, 9], unknown);
    assert_eq!(code, status::NV_ERR_INVALID_CLASS);
    let (code, _) = alloc(&ctl, [client ^ 0x0f0f, client, 9], class::NV01_DEVICE_0);
    assert_eq!(code, status::NV_ERR_INVALID_CLIENT);
    assert_eq!(
        calls::rm_free(&ctl, client, 1, 0x77).unwrap(),
        status::NV_ERR_INVALID_OBJECT_HANDLE
    );
    let mut scratch = [0u8; 16];
    let unknown_cmd = (0x2080_ff00u32..)
        .find(|c| ctrl::name(*c).is_none())
        .unwrap();
    let code = calls::rm_control(&ctl, client, 1, unknown_cmd, &mut scratch).unwrap();
    assert_eq!(code, status::NV_ERR_NOT_SUPPORTED);
    let code = calls::rm_control(
        &ctl,
        client,
        4,
        ctrl::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN,
        &mut scratch,
    )
    .unwrap();
    assert_eq!(code, status::NV_OK);
    let state = mock.state();
    assert_eq!(state.objects().count(), 4, "failed calls allocated nothing");
    assert_eq!(state.totals.failed_statuses, 6);
}

#[test]
fn freeing_an_object_frees_its_subtree_and_freeing_the_client_frees_all() {
    if skip("freeing_an_object_frees_its_subtree_and_freeing_the_client_frees_all") {
        return;
    }
    let mock = Mock::mount(VERSION, 1024);
    let ctl = NvFile::open(&mock.dir().join("nvidiactl")).unwrap();
    let client = channel_tree(&ctl);
    assert_eq!(calls::rm_free(&ctl, client, 1, 3).unwrap(), status::NV_OK);
    let state = mock.state();
    assert!(state.object(client, 1).is_some());
    for gone in [3, 4, 5] {
        assert!(
            state.object(client, gone).is_none(),
            "{gone:#x} freed with its parent"
        );
    }
    assert_eq!(
        calls::rm_free(&ctl, client, client, client).unwrap(),
        status::NV_OK
    );
    let state = mock.state();
    assert_eq!(state.clients().count(), 0);
    assert_eq!(state.files.len(), 1, "the file stays open");
}

#[test]
fn closing_the_last_fd_frees_everything_of_that_file() {
    if skip("closing_the_last_fd_frees_everything_of_that_file") {
        return;
    }
    let mock = Mock::mount(VERSION, 1024);
    let ctl = NvFile::open(&mock.dir().join("nvidiactl")).unwrap();
    let other = NvFile::open(&mock.dir().join("nvidiactl")).unwrap();
    let kept = channel_tree(&other);
    channel_tree(&ctl);
    // A dup'd fd keeps the file (and its objects) alive: the driver frees at the final release.
    let duplicate = ctl.as_fd().try_clone_to_owned().unwrap();
    drop(ctl);
    // FUSE sends releases asynchronously: a (wrong) early RELEASE would have arrived by now.
    mock.releases_delivered();
    assert_eq!(mock.state().clients().count(), 2);
    drop(duplicate);
    let state = mock.state_when(|s| s.files.len() == 1);
    assert_eq!(
        state.clients().map(|c| c.handle).collect::<Vec<_>>(),
        [kept]
    );
    assert_eq!(state.files.len(), 1);
}

#[test]
fn device_file_maps_shared_writable() {
    if skip("device_file_maps_shared_writable") {
        return;
    }
    let mock = Mock::mount(VERSION, 1024);
    let ctl = NvFile::open(&mock.dir().join("nvidiactl")).unwrap();
    let gpu = NvFile::open(&mock.dir().join("nvidia0")).unwrap();
    let client = new_client(&ctl);
    assert_eq!(
        alloc(&ctl, [client, client, 1], class::NV01_DEVICE_0).0,
        status::NV_OK
    );
    let mut params = calls::memory_alloc_params(&layout(), 1 << 20);
    let memory = calls::rm_alloc(
        &ctl,
        &layout(),
        AllocForm::Nvos21,
        [client, 1, 0],
        class::NV01_MEMORY_LOCAL_USER,
        Some(&mut params),
    )
    .unwrap();
    assert_eq!(memory.status, status::NV_OK);
    let mapped =
        calls::rm_map_memory(&ctl, [client, 1, memory.handle], 1 << 20, gpu.raw_fd()).unwrap();
    assert_eq!(mapped.status, status::NV_OK);
    let length = std::num::NonZeroUsize::new(1 << 20).unwrap();
    // SAFETY: a fresh shared mapping owned by this test; unmapped below before the file closes.
    let address = unsafe {
        nix::sys::mman::mmap(
            None,
            length,
            nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
            nix::sys::mman::MapFlags::MAP_SHARED,
            gpu.as_fd(),
            mapped.linear_address as i64,
        )
    }
    .unwrap();
    // SAFETY: both accesses are inside the 1 MiB writable mapping.
    unsafe {
        let bytes = address.cast::<u8>();
        bytes.add(4096).write_volatile(0xa5);
        assert_eq!(bytes.add(4096).read_volatile(), 0xa5);
        assert_eq!(
            bytes.read_volatile(),
            0,
            "fresh device memory reads as zeros"
        );
    }
    // The mapping holds the file: closing the fd does not release it yet.
    let gpu_path = gpu.path().to_owned();
    drop(gpu);
    mock.releases_delivered();
    assert_eq!(
        mock.state().files_named("nvidia0").count(),
        1,
        "mmap keeps {gpu_path:?} open"
    );
    // SAFETY: the region mmap returned above, no longer used.
    unsafe { nix::sys::mman::munmap(address, length.get()) }.unwrap();
    let state = mock.state_when(|s| s.files_named("nvidia0").count() == 0);
    assert_eq!(state.files_named("nvidia0").count(), 0);
}

#[test]
fn xfer_cmd_params_are_followed_into_caller_memory() {
    if skip("xfer_cmd_params_are_followed_into_caller_memory") {
        return;
    }
    let mock = Mock::mount(VERSION, 1024);
    let ctl = NvFile::open(&mock.dir().join("nvidiactl")).unwrap();
    let layout = layout();
    let mut inner = vec![0u8; layout.nvos21_size as usize];
    inner[rm_alloc::H_CLASS_OFFSET as usize..][..4]
        .copy_from_slice(&class::NV01_ROOT_CLIENT.to_le_bytes());
    // Poison the status so the test sees the driver write NV_OK.
    inner[layout.nvos21_status as usize..][..4].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut outer = vec![0u8; xfer::SIZE as usize];
    outer[xfer::CMD_OFFSET as usize..][..4].copy_from_slice(&escape::RM_ALLOC.to_le_bytes());
    outer[xfer::SIZE_OFFSET as usize..][..4].copy_from_slice(&layout.nvos21_size.to_le_bytes());
    outer[xfer::PTR_OFFSET as usize..][..8]
        .copy_from_slice(&(inner.as_mut_ptr() as u64).to_le_bytes());
    ctl.escape(escape::IOCTL_XFER_CMD, &mut outer).unwrap();
    let field = |offset: u32| u32::from_le_bytes(inner[offset as usize..][..4].try_into().unwrap());
    assert_eq!(field(layout.nvos21_status), status::NV_OK);
    let client = field(rm_alloc::H_OBJECT_NEW_OFFSET);
    assert_eq!(
        mock.state().clients().map(|c| c.handle).collect::<Vec<_>>(),
        [client]
    );
}

#[test]
fn a_struct_of_another_band_is_refused() {
    if skip("a_struct_of_another_band_is_refused") {
        return;
    }
    let mock = Mock::mount(VERSION, 1024);
    let ctl = NvFile::open(&mock.dir().join("nvidiactl")).unwrap();
    let old = Layout::for_version(DriverVersion::parse("520.61.05").unwrap());
    let error = calls::rm_alloc(
        &ctl,
        &old,
        AllocForm::Nvos64,
        [0, 0, 0],
        class::NV01_ROOT_CLIENT,
        None,
    )
    .unwrap_err();
    assert!(error.to_string().contains("Invalid argument"), "{error}");
    assert_eq!(mock.state().clients().count(), 0);
}

/// Video memory of `bytes` under `parent` through RM_ALLOC (the mock reads the size from the caller's
/// memory); returns the status.
fn alloc_vram(ctl: &NvFile, client: u32, parent: u32, bytes: u64) -> u32 {
    let mut params = calls::memory_alloc_params(&layout(), bytes);
    calls::rm_alloc(
        ctl,
        &layout(),
        AllocForm::Nvos64,
        [client, parent, 0],
        class::NV01_MEMORY_LOCAL_USER,
        Some(&mut params),
    )
    .expect("RM_ALLOC ioctl")
    .status
}

/// Each GPU has its capacity: video memory that does not fit in its device's GPU is refused with the
/// status, whatever another GPU has free, and never oversubscribes; a free makes room again. The device's
/// GPU is the `deviceId` of its `NV0080_ALLOC_PARAMETERS`, which the mock reads in the caller's memory.
#[test]
fn video_memory_past_a_gpus_capacity_is_refused() {
    if skip("video_memory_past_a_gpus_capacity_is_refused") {
        return;
    }
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().expect("temp dir");
    let options = MountOptions::new(dir.path())
        .with_driver_version(VERSION)
        .with_gpus(2)
        .with_vram_mib(64);
    let mock = MockDriver::mount(options).expect("mount the mock driver");
    let ctl = NvFile::open(&mock.path("nvidiactl")).unwrap();
    let client = new_client(&ctl);
    // Device 1 on GPU 1 (deviceId 1 in its NV0080_ALLOC_PARAMETERS), device 2 with no params: GPU 0.
    let mut nv0080 = [0u8; 56];
    nv0080[..4].copy_from_slice(&1u32.to_le_bytes());
    let done = calls::rm_alloc(
        &ctl,
        &layout(),
        AllocForm::Nvos64,
        [client, client, 1],
        class::NV01_DEVICE_0,
        Some(&mut nv0080),
    )
    .expect("RM_ALLOC ioctl");
    assert_eq!((done.status, done.handle), (status::NV_OK, 1));
    assert_eq!(
        alloc(&ctl, [client, client, 2], class::NV01_DEVICE_0),
        (status::NV_OK, 2)
    );
    assert_eq!(alloc_vram(&ctl, client, 1, 48 * MIB), status::NV_OK);
    assert_eq!(alloc_vram(&ctl, client, 1, 16 * MIB), status::NV_OK);
    let refused = status::NV_ERR_INSUFFICIENT_RESOURCES;
    assert_eq!(alloc_vram(&ctl, client, 1, 1), refused, "GPU 1 is full");
    assert_eq!(alloc_vram(&ctl, client, 2, 64 * MIB + 1), refused);
    assert_eq!(alloc_vram(&ctl, client, 2, 64 * MIB), status::NV_OK);
    let state = mock.state();
    assert_eq!(state.vram_bytes_per_gpu, 64 * MIB);
    assert_eq!(state.vram_used_bytes_per_gpu, vec![64 * MIB, 64 * MIB]);
    assert_eq!(
        (state.vram_bytes, state.vram_used_bytes),
        (128 * MIB, 128 * MIB)
    );
    // Freeing device 1 frees its memory: GPU 1 has room again, GPU 0 still none.
    assert_eq!(
        calls::rm_free(&ctl, client, client, 1).unwrap(),
        status::NV_OK
    );
    assert_eq!(alloc_vram(&ctl, client, 2, 1), refused);
    assert_eq!(mock.state().vram_used_bytes_per_gpu, vec![64 * MIB, 0]);
    drop(ctl);
    let idle = DriverState::wait_for(mock.mountpoint(), common::TIMEOUT, DriverState::is_idle)
        .expect("read state.json");
    assert_eq!(idle.vram_used_bytes_per_gpu, vec![0, 0]);
}
