//! UVM ioctl commands (`/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`): numbers, names and params layouts
//! per driver band.
//!
//! UVM commands are *not* `_IOC`-encoded: the ioctl command is the bare number (strace shows
//! `_IOC(_IOC_NONE,0,nr,0)`). The ioctl returns 0 with the result in the params' `rmStatus` (or -EAGAIN
//! when the driver's pm lock is busy). Source: `kernel-open/nvidia-uvm/uvm_ioctl.h` and
//! `uvm_linux_ioctl.h`; sizes and `rmStatus` offsets were taken with `sizeof`/`offsetof` at the last tag of
//! every major release from 515 to 595 (x86_64). Commands that exist only in some bands are included.

/// Size and `rmStatus` offset of a UVM params struct in one driver band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UvmParams {
    /// `sizeof` the params struct.
    pub size: u32,
    /// Offset of `rmStatus`; `None` when the struct has none.
    pub status_offset: Option<u32>,
}

use crate::layout::DriverVersion;

const fn p(size: u32, status: u32) -> Option<UvmParams> {
    Some(UvmParams {
        size,
        status_offset: Some(status),
    })
}

const fn p_no_status(size: u32) -> Option<UvmParams> {
    Some(UvmParams {
        size,
        status_offset: None,
    })
}

/// `UVM_RESERVE_VA`.
pub const RESERVE_VA: u32 = 1;
/// `UVM_RELEASE_VA`.
pub const RELEASE_VA: u32 = 2;
/// `UVM_REGION_COMMIT`.
pub const REGION_COMMIT: u32 = 3;
/// `UVM_REGION_DECOMMIT`.
pub const REGION_DECOMMIT: u32 = 4;
/// `UVM_REGION_SET_STREAM`.
pub const REGION_SET_STREAM: u32 = 5;
/// `UVM_SET_STREAM_RUNNING`.
pub const SET_STREAM_RUNNING: u32 = 6;
/// `UVM_SET_STREAM_STOPPED`.
pub const SET_STREAM_STOPPED: u32 = 7;
/// `UVM_RUN_TEST`.
pub const RUN_TEST: u32 = 9;
/// `UVM_ADD_SESSION`.
pub const ADD_SESSION: u32 = 10;
/// `UVM_REMOVE_SESSION`.
pub const REMOVE_SESSION: u32 = 11;
/// `UVM_ENABLE_COUNTERS`.
pub const ENABLE_COUNTERS: u32 = 12;
/// `UVM_MAP_COUNTER`.
pub const MAP_COUNTER: u32 = 13;
/// `UVM_CREATE_EVENT_QUEUE`.
pub const CREATE_EVENT_QUEUE: u32 = 14;
/// `UVM_REMOVE_EVENT_QUEUE`.
pub const REMOVE_EVENT_QUEUE: u32 = 15;
/// `UVM_MAP_EVENT_QUEUE`.
pub const MAP_EVENT_QUEUE: u32 = 16;
/// `UVM_EVENT_CTRL`.
pub const EVENT_CTRL: u32 = 17;
/// `UVM_REGISTER_MPS_SERVER`.
pub const REGISTER_MPS_SERVER: u32 = 18;
/// `UVM_REGISTER_MPS_CLIENT`.
pub const REGISTER_MPS_CLIENT: u32 = 19;
/// `UVM_GET_GPU_UUID_TABLE`.
pub const GET_GPU_UUID_TABLE: u32 = 20;
/// `UVM_REGION_SET_BACKING`.
pub const REGION_SET_BACKING: u32 = 21;
/// `UVM_REGION_UNSET_BACKING`.
pub const REGION_UNSET_BACKING: u32 = 22;
/// `UVM_CREATE_RANGE_GROUP`.
pub const CREATE_RANGE_GROUP: u32 = 23;
/// `UVM_DESTROY_RANGE_GROUP`.
pub const DESTROY_RANGE_GROUP: u32 = 24;
/// `UVM_REGISTER_GPU_VASPACE`.
pub const REGISTER_GPU_VASPACE: u32 = 25;
/// `UVM_UNREGISTER_GPU_VASPACE`.
pub const UNREGISTER_GPU_VASPACE: u32 = 26;
/// `UVM_REGISTER_CHANNEL`.
pub const REGISTER_CHANNEL: u32 = 27;
/// `UVM_UNREGISTER_CHANNEL`.
pub const UNREGISTER_CHANNEL: u32 = 28;
/// `UVM_ENABLE_PEER_ACCESS`.
pub const ENABLE_PEER_ACCESS: u32 = 29;
/// `UVM_DISABLE_PEER_ACCESS`.
pub const DISABLE_PEER_ACCESS: u32 = 30;
/// `UVM_SET_RANGE_GROUP`.
pub const SET_RANGE_GROUP: u32 = 31;
/// `UVM_MAP_EXTERNAL_ALLOCATION`.
pub const MAP_EXTERNAL_ALLOCATION: u32 = 33;
/// `UVM_FREE`.
pub const FREE: u32 = 34;
/// `UVM_MEM_MAP`.
pub const MEM_MAP: u32 = 35;
/// `UVM_DEBUG_ACCESS_MEMORY`.
pub const DEBUG_ACCESS_MEMORY: u32 = 36;
/// `UVM_REGISTER_GPU`.
pub const REGISTER_GPU: u32 = 37;
/// `UVM_UNREGISTER_GPU`.
pub const UNREGISTER_GPU: u32 = 38;
/// `UVM_PAGEABLE_MEM_ACCESS`.
pub const PAGEABLE_MEM_ACCESS: u32 = 39;
/// `UVM_PREVENT_MIGRATION_RANGE_GROUPS`.
pub const PREVENT_MIGRATION_RANGE_GROUPS: u32 = 40;
/// `UVM_ALLOW_MIGRATION_RANGE_GROUPS`.
pub const ALLOW_MIGRATION_RANGE_GROUPS: u32 = 41;
/// `UVM_SET_PREFERRED_LOCATION`.
pub const SET_PREFERRED_LOCATION: u32 = 42;
/// `UVM_UNSET_PREFERRED_LOCATION`.
pub const UNSET_PREFERRED_LOCATION: u32 = 43;
/// `UVM_ENABLE_READ_DUPLICATION`.
pub const ENABLE_READ_DUPLICATION: u32 = 44;
/// `UVM_DISABLE_READ_DUPLICATION`.
pub const DISABLE_READ_DUPLICATION: u32 = 45;
/// `UVM_SET_ACCESSED_BY`.
pub const SET_ACCESSED_BY: u32 = 46;
/// `UVM_UNSET_ACCESSED_BY`.
pub const UNSET_ACCESSED_BY: u32 = 47;
/// `UVM_MIGRATE`.
pub const MIGRATE: u32 = 51;
/// `UVM_MIGRATE_RANGE_GROUP`.
pub const MIGRATE_RANGE_GROUP: u32 = 53;
/// `UVM_ENABLE_SYSTEM_WIDE_ATOMICS`.
pub const ENABLE_SYSTEM_WIDE_ATOMICS: u32 = 54;
/// `UVM_DISABLE_SYSTEM_WIDE_ATOMICS`.
pub const DISABLE_SYSTEM_WIDE_ATOMICS: u32 = 55;
/// `UVM_TOOLS_INIT_EVENT_TRACKER`.
pub const TOOLS_INIT_EVENT_TRACKER: u32 = 56;
/// `UVM_TOOLS_SET_NOTIFICATION_THRESHOLD`.
pub const TOOLS_SET_NOTIFICATION_THRESHOLD: u32 = 57;
/// `UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS`.
pub const TOOLS_EVENT_QUEUE_ENABLE_EVENTS: u32 = 58;
/// `UVM_TOOLS_EVENT_QUEUE_DISABLE_EVENTS`.
pub const TOOLS_EVENT_QUEUE_DISABLE_EVENTS: u32 = 59;
/// `UVM_TOOLS_ENABLE_COUNTERS`.
pub const TOOLS_ENABLE_COUNTERS: u32 = 60;
/// `UVM_TOOLS_DISABLE_COUNTERS`.
pub const TOOLS_DISABLE_COUNTERS: u32 = 61;
/// `UVM_TOOLS_READ_PROCESS_MEMORY`.
pub const TOOLS_READ_PROCESS_MEMORY: u32 = 62;
/// `UVM_TOOLS_WRITE_PROCESS_MEMORY`.
pub const TOOLS_WRITE_PROCESS_MEMORY: u32 = 63;
/// `UVM_TOOLS_GET_PROCESSOR_UUID_TABLE`.
pub const TOOLS_GET_PROCESSOR_UUID_TABLE: u32 = 64;
/// `UVM_MAP_DYNAMIC_PARALLELISM_REGION`.
pub const MAP_DYNAMIC_PARALLELISM_REGION: u32 = 65;
/// `UVM_UNMAP_EXTERNAL`.
pub const UNMAP_EXTERNAL: u32 = 66;
/// `UVM_TOOLS_FLUSH_EVENTS`.
pub const TOOLS_FLUSH_EVENTS: u32 = 67;
/// `UVM_ALLOC_SEMAPHORE_POOL`.
pub const ALLOC_SEMAPHORE_POOL: u32 = 68;
/// `UVM_CLEAN_UP_ZOMBIE_RESOURCES`.
pub const CLEAN_UP_ZOMBIE_RESOURCES: u32 = 69;
/// `UVM_PAGEABLE_MEM_ACCESS_ON_GPU`.
pub const PAGEABLE_MEM_ACCESS_ON_GPU: u32 = 70;
/// `UVM_POPULATE_PAGEABLE`.
pub const POPULATE_PAGEABLE: u32 = 71;
/// `UVM_VALIDATE_VA_RANGE`.
pub const VALIDATE_VA_RANGE: u32 = 72;
/// `UVM_CREATE_EXTERNAL_RANGE`.
pub const CREATE_EXTERNAL_RANGE: u32 = 73;
/// `UVM_MAP_EXTERNAL_SPARSE`.
pub const MAP_EXTERNAL_SPARSE: u32 = 74;
/// `UVM_MM_INITIALIZE`.
pub const MM_INITIALIZE: u32 = 75;
/// `UVM_TOOLS_INIT_EVENT_TRACKER_V2`.
pub const TOOLS_INIT_EVENT_TRACKER_V2: u32 = 76;
/// `UVM_TOOLS_GET_PROCESSOR_UUID_TABLE_V2`.
pub const TOOLS_GET_PROCESSOR_UUID_TABLE_V2: u32 = 77;
/// `UVM_ALLOC_DEVICE_P2P`.
pub const ALLOC_DEVICE_P2P: u32 = 78;
/// `UVM_CLEAR_ALL_ACCESS_COUNTERS`.
pub const CLEAR_ALL_ACCESS_COUNTERS: u32 = 79;
/// `UVM_DISCARD`.
pub const DISCARD: u32 = 80;
/// `UVM_IS_8_SUPPORTED`.
pub const IS_8_SUPPORTED: u32 = 2047;
/// `UVM_INITIALIZE`.
pub const INITIALIZE: u32 = 0x30000001;
/// `UVM_DEINITIALIZE`.
pub const DEINITIALIZE: u32 = 0x30000002;

/// Every command above.
pub const ALL: [u32; 77] = [
    RESERVE_VA,
    RELEASE_VA,
    REGION_COMMIT,
    REGION_DECOMMIT,
    REGION_SET_STREAM,
    SET_STREAM_RUNNING,
    SET_STREAM_STOPPED,
    RUN_TEST,
    ADD_SESSION,
    REMOVE_SESSION,
    ENABLE_COUNTERS,
    MAP_COUNTER,
    CREATE_EVENT_QUEUE,
    REMOVE_EVENT_QUEUE,
    MAP_EVENT_QUEUE,
    EVENT_CTRL,
    REGISTER_MPS_SERVER,
    REGISTER_MPS_CLIENT,
    GET_GPU_UUID_TABLE,
    REGION_SET_BACKING,
    REGION_UNSET_BACKING,
    CREATE_RANGE_GROUP,
    DESTROY_RANGE_GROUP,
    REGISTER_GPU_VASPACE,
    UNREGISTER_GPU_VASPACE,
    REGISTER_CHANNEL,
    UNREGISTER_CHANNEL,
    ENABLE_PEER_ACCESS,
    DISABLE_PEER_ACCESS,
    SET_RANGE_GROUP,
    MAP_EXTERNAL_ALLOCATION,
    FREE,
    MEM_MAP,
    DEBUG_ACCESS_MEMORY,
    REGISTER_GPU,
    UNREGISTER_GPU,
    PAGEABLE_MEM_ACCESS,
    PREVENT_MIGRATION_RANGE_GROUPS,
    ALLOW_MIGRATION_RANGE_GROUPS,
    SET_PREFERRED_LOCATION,
    UNSET_PREFERRED_LOCATION,
    ENABLE_READ_DUPLICATION,
    DISABLE_READ_DUPLICATION,
    SET_ACCESSED_BY,
    UNSET_ACCESSED_BY,
    MIGRATE,
    MIGRATE_RANGE_GROUP,
    ENABLE_SYSTEM_WIDE_ATOMICS,
    DISABLE_SYSTEM_WIDE_ATOMICS,
    TOOLS_INIT_EVENT_TRACKER,
    TOOLS_SET_NOTIFICATION_THRESHOLD,
    TOOLS_EVENT_QUEUE_ENABLE_EVENTS,
    TOOLS_EVENT_QUEUE_DISABLE_EVENTS,
    TOOLS_ENABLE_COUNTERS,
    TOOLS_DISABLE_COUNTERS,
    TOOLS_READ_PROCESS_MEMORY,
    TOOLS_WRITE_PROCESS_MEMORY,
    TOOLS_GET_PROCESSOR_UUID_TABLE,
    MAP_DYNAMIC_PARALLELISM_REGION,
    UNMAP_EXTERNAL,
    TOOLS_FLUSH_EVENTS,
    ALLOC_SEMAPHORE_POOL,
    CLEAN_UP_ZOMBIE_RESOURCES,
    PAGEABLE_MEM_ACCESS_ON_GPU,
    POPULATE_PAGEABLE,
    VALIDATE_VA_RANGE,
    CREATE_EXTERNAL_RANGE,
    MAP_EXTERNAL_SPARSE,
    MM_INITIALIZE,
    TOOLS_INIT_EVENT_TRACKER_V2,
    TOOLS_GET_PROCESSOR_UUID_TABLE_V2,
    ALLOC_DEVICE_P2P,
    CLEAR_ALL_ACCESS_COUNTERS,
    DISCARD,
    IS_8_SUPPORTED,
    INITIALIZE,
    DEINITIALIZE,
];

/// The `UVM_*` name of a command.
pub fn name(cmd: u32) -> Option<&'static str> {
    Some(match cmd {
        RESERVE_VA => "UVM_RESERVE_VA",
        RELEASE_VA => "UVM_RELEASE_VA",
        REGION_COMMIT => "UVM_REGION_COMMIT",
        REGION_DECOMMIT => "UVM_REGION_DECOMMIT",
        REGION_SET_STREAM => "UVM_REGION_SET_STREAM",
        SET_STREAM_RUNNING => "UVM_SET_STREAM_RUNNING",
        SET_STREAM_STOPPED => "UVM_SET_STREAM_STOPPED",
        RUN_TEST => "UVM_RUN_TEST",
        ADD_SESSION => "UVM_ADD_SESSION",
        REMOVE_SESSION => "UVM_REMOVE_SESSION",
        ENABLE_COUNTERS => "UVM_ENABLE_COUNTERS",
        MAP_COUNTER => "UVM_MAP_COUNTER",
        CREATE_EVENT_QUEUE => "UVM_CREATE_EVENT_QUEUE",
        REMOVE_EVENT_QUEUE => "UVM_REMOVE_EVENT_QUEUE",
        MAP_EVENT_QUEUE => "UVM_MAP_EVENT_QUEUE",
        EVENT_CTRL => "UVM_EVENT_CTRL",
        REGISTER_MPS_SERVER => "UVM_REGISTER_MPS_SERVER",
        REGISTER_MPS_CLIENT => "UVM_REGISTER_MPS_CLIENT",
        GET_GPU_UUID_TABLE => "UVM_GET_GPU_UUID_TABLE",
        REGION_SET_BACKING => "UVM_REGION_SET_BACKING",
        REGION_UNSET_BACKING => "UVM_REGION_UNSET_BACKING",
        CREATE_RANGE_GROUP => "UVM_CREATE_RANGE_GROUP",
        DESTROY_RANGE_GROUP => "UVM_DESTROY_RANGE_GROUP",
        REGISTER_GPU_VASPACE => "UVM_REGISTER_GPU_VASPACE",
        UNREGISTER_GPU_VASPACE => "UVM_UNREGISTER_GPU_VASPACE",
        REGISTER_CHANNEL => "UVM_REGISTER_CHANNEL",
        UNREGISTER_CHANNEL => "UVM_UNREGISTER_CHANNEL",
        ENABLE_PEER_ACCESS => "UVM_ENABLE_PEER_ACCESS",
        DISABLE_PEER_ACCESS => "UVM_DISABLE_PEER_ACCESS",
        SET_RANGE_GROUP => "UVM_SET_RANGE_GROUP",
        MAP_EXTERNAL_ALLOCATION => "UVM_MAP_EXTERNAL_ALLOCATION",
        FREE => "UVM_FREE",
        MEM_MAP => "UVM_MEM_MAP",
        DEBUG_ACCESS_MEMORY => "UVM_DEBUG_ACCESS_MEMORY",
        REGISTER_GPU => "UVM_REGISTER_GPU",
        UNREGISTER_GPU => "UVM_UNREGISTER_GPU",
        PAGEABLE_MEM_ACCESS => "UVM_PAGEABLE_MEM_ACCESS",
        PREVENT_MIGRATION_RANGE_GROUPS => "UVM_PREVENT_MIGRATION_RANGE_GROUPS",
        ALLOW_MIGRATION_RANGE_GROUPS => "UVM_ALLOW_MIGRATION_RANGE_GROUPS",
        SET_PREFERRED_LOCATION => "UVM_SET_PREFERRED_LOCATION",
        UNSET_PREFERRED_LOCATION => "UVM_UNSET_PREFERRED_LOCATION",
        ENABLE_READ_DUPLICATION => "UVM_ENABLE_READ_DUPLICATION",
        DISABLE_READ_DUPLICATION => "UVM_DISABLE_READ_DUPLICATION",
        SET_ACCESSED_BY => "UVM_SET_ACCESSED_BY",
        UNSET_ACCESSED_BY => "UVM_UNSET_ACCESSED_BY",
        MIGRATE => "UVM_MIGRATE",
        MIGRATE_RANGE_GROUP => "UVM_MIGRATE_RANGE_GROUP",
        ENABLE_SYSTEM_WIDE_ATOMICS => "UVM_ENABLE_SYSTEM_WIDE_ATOMICS",
        DISABLE_SYSTEM_WIDE_ATOMICS => "UVM_DISABLE_SYSTEM_WIDE_ATOMICS",
        TOOLS_INIT_EVENT_TRACKER => "UVM_TOOLS_INIT_EVENT_TRACKER",
        TOOLS_SET_NOTIFICATION_THRESHOLD => "UVM_TOOLS_SET_NOTIFICATION_THRESHOLD",
        TOOLS_EVENT_QUEUE_ENABLE_EVENTS => "UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS",
        TOOLS_EVENT_QUEUE_DISABLE_EVENTS => "UVM_TOOLS_EVENT_QUEUE_DISABLE_EVENTS",
        TOOLS_ENABLE_COUNTERS => "UVM_TOOLS_ENABLE_COUNTERS",
        TOOLS_DISABLE_COUNTERS => "UVM_TOOLS_DISABLE_COUNTERS",
        TOOLS_READ_PROCESS_MEMORY => "UVM_TOOLS_READ_PROCESS_MEMORY",
        TOOLS_WRITE_PROCESS_MEMORY => "UVM_TOOLS_WRITE_PROCESS_MEMORY",
        TOOLS_GET_PROCESSOR_UUID_TABLE => "UVM_TOOLS_GET_PROCESSOR_UUID_TABLE",
        MAP_DYNAMIC_PARALLELISM_REGION => "UVM_MAP_DYNAMIC_PARALLELISM_REGION",
        UNMAP_EXTERNAL => "UVM_UNMAP_EXTERNAL",
        TOOLS_FLUSH_EVENTS => "UVM_TOOLS_FLUSH_EVENTS",
        ALLOC_SEMAPHORE_POOL => "UVM_ALLOC_SEMAPHORE_POOL",
        CLEAN_UP_ZOMBIE_RESOURCES => "UVM_CLEAN_UP_ZOMBIE_RESOURCES",
        PAGEABLE_MEM_ACCESS_ON_GPU => "UVM_PAGEABLE_MEM_ACCESS_ON_GPU",
        POPULATE_PAGEABLE => "UVM_POPULATE_PAGEABLE",
        VALIDATE_VA_RANGE => "UVM_VALIDATE_VA_RANGE",
        CREATE_EXTERNAL_RANGE => "UVM_CREATE_EXTERNAL_RANGE",
        MAP_EXTERNAL_SPARSE => "UVM_MAP_EXTERNAL_SPARSE",
        MM_INITIALIZE => "UVM_MM_INITIALIZE",
        TOOLS_INIT_EVENT_TRACKER_V2 => "UVM_TOOLS_INIT_EVENT_TRACKER_V2",
        TOOLS_GET_PROCESSOR_UUID_TABLE_V2 => "UVM_TOOLS_GET_PROCESSOR_UUID_TABLE_V2",
        ALLOC_DEVICE_P2P => "UVM_ALLOC_DEVICE_P2P",
        CLEAR_ALL_ACCESS_COUNTERS => "UVM_CLEAR_ALL_ACCESS_COUNTERS",
        DISCARD => "UVM_DISCARD",
        IS_8_SUPPORTED => "UVM_IS_8_SUPPORTED",
        INITIALIZE => "UVM_INITIALIZE",
        DEINITIALIZE => "UVM_DEINITIALIZE",
        _ => return None,
    })
}

/// The major release whose UVM_MAX_GPUS_V2-sized structs driver `v` uses: its own, except the first 550
/// release (550.40.07 and anything before 550.40.53), which still had the 545 ones
/// (MAP_EXTERNAL_ALLOCATION, ALLOC_SEMAPHORE_POOL and two tools commands grew with UVM_MAX_GPUS_V2 at
/// 550.40.53). Other commands change at the major boundary: use [`band_major_for`].
pub const fn band_major(v: DriverVersion) -> u32 {
    if v.major == 550 && (v.minor < 40 || (v.minor == 40 && v.patch < 53)) {
        545
    } else {
        v.major
    }
}

/// Whether `cmd`'s params grew with UVM_MAX_GPUS_V2 at 550.40.53 (rather than at 550.40.07).
const fn grew_with_max_gpus_v2(cmd: u32) -> bool {
    matches!(
        cmd,
        MAP_EXTERNAL_ALLOCATION
            | ALLOC_SEMAPHORE_POOL
            | TOOLS_INIT_EVENT_TRACKER
            | TOOLS_GET_PROCESSOR_UUID_TABLE
    )
}

/// The major release whose params layout of `cmd` driver `v` uses: [`band_major`] for the commands that
/// grew with UVM_MAX_GPUS_V2 at 550.40.53, `v.major` for the rest (UVM_SET_PREFERRED_LOCATION already
/// has its 550 layout, rmStatus@36, at 550.40.07).
pub const fn band_major_for(cmd: u32, v: DriverVersion) -> u32 {
    if grew_with_max_gpus_v2(cmd) {
        band_major(v)
    } else {
        v.major
    }
}

/// Size and `rmStatus` offset of `cmd`'s params for driver `v` (handles the 550.40.07 quirk through
/// [`band_major_for`]). [`crate::layout::Layout::uvm_params`] calls this.
pub const fn params_for_version(cmd: u32, v: DriverVersion) -> Option<UvmParams> {
    params_layout(cmd, band_major_for(cmd, v))
}

/// The first release without the UVM range-group ioctls (gVisor `pkg/sentry/devices/nvproxy/version.go`:
/// "UVM range groups were removed in 610.43.02").
pub const RANGE_GROUPS_REMOVED: DriverVersion = DriverVersion::new(610, 43, 2);

/// Whether `cmd` is a range-group ioctl (CREATE/DESTROY/SET/MIGRATE_RANGE_GROUP), removed in 610.43.02.
pub const fn is_range_group(cmd: u32) -> bool {
    matches!(
        cmd,
        CREATE_RANGE_GROUP | DESTROY_RANGE_GROUP | SET_RANGE_GROUP | MIGRATE_RANGE_GROUP
    )
}

/// The `UVM_*` name of `cmd` in driver `v`: [`name`], except that the range-group ioctls are unknown from
/// 610.43.02 on.
pub fn name_for(cmd: u32, v: DriverVersion) -> Option<&'static str> {
    if is_range_group(cmd) && v.at_least(RANGE_GROUPS_REMOVED) {
        return None;
    }
    name(cmd)
}

/// Size and `rmStatus` offset of `cmd`'s params in the structs of major release `major` (e.g. 595).
///
/// Majors below 515 are treated as 515, 596..609 as 595, 610 and above as 610 (the range-group ioctls are
/// gone); `None` when the command does not exist in that band or its params are unknown. Prefer
/// [`params_for_version`] when the full version is known.
pub const fn params_layout(cmd: u32, major: u32) -> Option<UvmParams> {
    match cmd {
        RESERVE_VA => p(24, 16),
        RELEASE_VA => p(24, 16),
        REGION_COMMIT => p(48, 40),
        REGION_DECOMMIT => p(24, 16),
        REGION_SET_STREAM => p(48, 40),
        SET_STREAM_RUNNING => p(16, 8),
        SET_STREAM_STOPPED => p(272, 264),
        RUN_TEST => {
            if major >= 590 {
                None
            } else {
                p(44, 40)
            }
        }
        ADD_SESSION => {
            if major >= 590 {
                p(8, 4)
            } else {
                p(24, 20)
            }
        }
        REMOVE_SESSION => {
            if major >= 590 {
                None
            } else {
                p(8, 4)
            }
        }
        ENABLE_COUNTERS => {
            if major >= 590 {
                p(904, 900)
            } else {
                p(908, 904)
            }
        }
        MAP_COUNTER => {
            if major >= 590 {
                p(40, 32)
            } else {
                p(48, 40)
            }
        }
        CREATE_EVENT_QUEUE => {
            if major >= 590 {
                p(40, 36)
            } else {
                p(32, 28)
            }
        }
        REMOVE_EVENT_QUEUE => {
            if major >= 590 {
                p(8, 4)
            } else {
                p(12, 8)
            }
        }
        MAP_EVENT_QUEUE => p(56, 48),
        EVENT_CTRL => {
            if major >= 590 {
                p(16, 12)
            } else {
                p(20, 16)
            }
        }
        REGISTER_MPS_SERVER => {
            if major >= 590 {
                None
            } else {
                p(536, 528)
            }
        }
        REGISTER_MPS_CLIENT => {
            if major >= 590 {
                None
            } else {
                p(16, 8)
            }
        }
        GET_GPU_UUID_TABLE => p(520, 516),
        REGION_SET_BACKING => None,
        REGION_UNSET_BACKING => None,
        CREATE_RANGE_GROUP => {
            if major >= 610 {
                None
            } else {
                p(16, 8)
            }
        }
        DESTROY_RANGE_GROUP => {
            if major >= 610 {
                None
            } else {
                p(16, 8)
            }
        }
        REGISTER_GPU_VASPACE => p(32, 28),
        UNREGISTER_GPU_VASPACE => p(20, 16),
        REGISTER_CHANNEL => p(56, 48),
        UNREGISTER_CHANNEL => {
            if major >= 590 {
                p(12, 8)
            } else {
                p(28, 24)
            }
        }
        ENABLE_PEER_ACCESS => p(36, 32),
        DISABLE_PEER_ACCESS => p(36, 32),
        SET_RANGE_GROUP => {
            if major >= 610 {
                None
            } else {
                p(32, 24)
            }
        }
        MAP_EXTERNAL_ALLOCATION => {
            if major >= 550 {
                p(9264, 9260)
            } else {
                p(1200, 1196)
            }
        }
        FREE => {
            if major >= 590 {
                p(16, 8)
            } else {
                p(24, 16)
            }
        }
        MEM_MAP => p(24, 16),
        DEBUG_ACCESS_MEMORY => {
            if major >= 575 {
                None
            } else {
                p(64, 56)
            }
        }
        REGISTER_GPU => p(40, 36),
        UNREGISTER_GPU => p(20, 16),
        PAGEABLE_MEM_ACCESS => p(8, 4),
        PREVENT_MIGRATION_RANGE_GROUPS => p(272, 264),
        ALLOW_MIGRATION_RANGE_GROUPS => p(272, 264),
        SET_PREFERRED_LOCATION => {
            if major >= 550 {
                p(40, 36)
            } else {
                p(40, 32)
            }
        }
        UNSET_PREFERRED_LOCATION => p(24, 16),
        ENABLE_READ_DUPLICATION => p(24, 16),
        DISABLE_READ_DUPLICATION => p(24, 16),
        SET_ACCESSED_BY => p(40, 32),
        UNSET_ACCESSED_BY => p(40, 32),
        MIGRATE => p(80, 72),
        MIGRATE_RANGE_GROUP => {
            if major >= 610 {
                None
            } else {
                p(32, 24)
            }
        }
        ENABLE_SYSTEM_WIDE_ATOMICS => {
            if major >= 595 {
                None
            } else {
                p(20, 16)
            }
        }
        DISABLE_SYSTEM_WIDE_ATOMICS => {
            if major >= 595 {
                None
            } else {
                p(20, 16)
            }
        }
        TOOLS_INIT_EVENT_TRACKER => {
            if major >= 565 {
                p(56, 48)
            } else if major >= 560 {
                p(56, 52)
            } else if major >= 550 {
                p(64, 48)
            } else {
                p(56, 48)
            }
        }
        TOOLS_SET_NOTIFICATION_THRESHOLD => p(8, 4),
        TOOLS_EVENT_QUEUE_ENABLE_EVENTS => p(16, 8),
        TOOLS_EVENT_QUEUE_DISABLE_EVENTS => p(16, 8),
        TOOLS_ENABLE_COUNTERS => p(16, 8),
        TOOLS_DISABLE_COUNTERS => p(16, 8),
        TOOLS_READ_PROCESS_MEMORY => p(40, 32),
        TOOLS_WRITE_PROCESS_MEMORY => p(40, 32),
        TOOLS_GET_PROCESSOR_UUID_TABLE => {
            if major >= 565 {
                p(16, 8)
            } else if major >= 560 {
                p(16, 12)
            } else if major >= 550 {
                p(24, 12)
            } else {
                p(16, 12)
            }
        }
        MAP_DYNAMIC_PARALLELISM_REGION => p(40, 32),
        UNMAP_EXTERNAL => p(40, 32),
        TOOLS_FLUSH_EVENTS => p(4, 0),
        ALLOC_SEMAPHORE_POOL => {
            if major >= 550 {
                p(9248, 9240)
            } else {
                p(1184, 1176)
            }
        }
        CLEAN_UP_ZOMBIE_RESOURCES => p(4, 0),
        PAGEABLE_MEM_ACCESS_ON_GPU => p(24, 20),
        POPULATE_PAGEABLE => p(24, 20),
        VALIDATE_VA_RANGE => p(24, 16),
        CREATE_EXTERNAL_RANGE => p(24, 16),
        MAP_EXTERNAL_SPARSE => p(40, 32),
        MM_INITIALIZE => {
            if major >= 535 {
                p(8, 4)
            } else {
                None
            }
        }
        TOOLS_INIT_EVENT_TRACKER_V2 => {
            if major >= 565 {
                p(56, 48)
            } else {
                None
            }
        }
        TOOLS_GET_PROCESSOR_UUID_TABLE_V2 => {
            if major >= 565 {
                p(16, 8)
            } else {
                None
            }
        }
        ALLOC_DEVICE_P2P => {
            if major >= 565 {
                p(56, 52)
            } else {
                None
            }
        }
        CLEAR_ALL_ACCESS_COUNTERS => {
            if major >= 565 {
                p(4, 0)
            } else {
                None
            }
        }
        DISCARD => {
            if major >= 580 {
                p(32, 24)
            } else {
                None
            }
        }
        IS_8_SUPPORTED => p(8, 4),
        INITIALIZE => p(16, 8),
        DEINITIALIZE => p_no_status(0),
        _ => None,
    }
}

/// Bytes a tracer should read at the ioctl's `arg` for `cmd`: the largest params size over all driver
/// bands (0 when unknown or the command takes no params). Large ones (MAP_EXTERNAL_ALLOCATION 9264,
/// ALLOC_SEMAPHORE_POOL 9248) exceed a BPF stack; tracers cap the read at their buffer size.
#[inline(always)]
pub const fn capture_size(cmd: u32) -> u32 {
    match cmd {
        TOOLS_FLUSH_EVENTS | CLEAN_UP_ZOMBIE_RESOURCES | CLEAR_ALL_ACCESS_COUNTERS => 4,
        REMOVE_SESSION
        | PAGEABLE_MEM_ACCESS
        | TOOLS_SET_NOTIFICATION_THRESHOLD
        | MM_INITIALIZE
        | IS_8_SUPPORTED => 8,
        REMOVE_EVENT_QUEUE => 12,
        SET_STREAM_RUNNING
        | REGISTER_MPS_CLIENT
        | CREATE_RANGE_GROUP
        | DESTROY_RANGE_GROUP
        | TOOLS_EVENT_QUEUE_ENABLE_EVENTS
        | TOOLS_EVENT_QUEUE_DISABLE_EVENTS
        | TOOLS_ENABLE_COUNTERS
        | TOOLS_DISABLE_COUNTERS
        | TOOLS_GET_PROCESSOR_UUID_TABLE_V2
        | INITIALIZE => 16,
        EVENT_CTRL
        | UNREGISTER_GPU_VASPACE
        | UNREGISTER_GPU
        | ENABLE_SYSTEM_WIDE_ATOMICS
        | DISABLE_SYSTEM_WIDE_ATOMICS => 20,
        RESERVE_VA
        | RELEASE_VA
        | REGION_DECOMMIT
        | ADD_SESSION
        | FREE
        | MEM_MAP
        | UNSET_PREFERRED_LOCATION
        | ENABLE_READ_DUPLICATION
        | DISABLE_READ_DUPLICATION
        | TOOLS_GET_PROCESSOR_UUID_TABLE
        | PAGEABLE_MEM_ACCESS_ON_GPU
        | POPULATE_PAGEABLE
        | VALIDATE_VA_RANGE
        | CREATE_EXTERNAL_RANGE => 24,
        UNREGISTER_CHANNEL => 28,
        REGISTER_GPU_VASPACE | SET_RANGE_GROUP | MIGRATE_RANGE_GROUP | DISCARD => 32,
        ENABLE_PEER_ACCESS | DISABLE_PEER_ACCESS => 36,
        CREATE_EVENT_QUEUE
        | REGISTER_GPU
        | SET_PREFERRED_LOCATION
        | SET_ACCESSED_BY
        | UNSET_ACCESSED_BY
        | TOOLS_READ_PROCESS_MEMORY
        | TOOLS_WRITE_PROCESS_MEMORY
        | MAP_DYNAMIC_PARALLELISM_REGION
        | UNMAP_EXTERNAL
        | MAP_EXTERNAL_SPARSE => 40,
        RUN_TEST => 44,
        REGION_COMMIT | REGION_SET_STREAM | MAP_COUNTER => 48,
        MAP_EVENT_QUEUE | REGISTER_CHANNEL | TOOLS_INIT_EVENT_TRACKER_V2 | ALLOC_DEVICE_P2P => 56,
        DEBUG_ACCESS_MEMORY | TOOLS_INIT_EVENT_TRACKER => 64,
        MIGRATE => 80,
        SET_STREAM_STOPPED | PREVENT_MIGRATION_RANGE_GROUPS | ALLOW_MIGRATION_RANGE_GROUPS => 272,
        GET_GPU_UUID_TABLE => 520,
        REGISTER_MPS_SERVER => 536,
        ENABLE_COUNTERS => 908,
        ALLOC_SEMAPHORE_POOL => 9248,
        MAP_EXTERNAL_ALLOCATION => 9264,
        _ => 0,
    }
}
/// Whether `cmd` is one of the UVM tools commands (`/dev/nvidia-uvm-tools` event trackers).
#[inline(always)]
pub const fn is_tools(cmd: u32) -> bool {
    matches!(cmd, 56..=64 | 67 | 76 | 77)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_has_a_name_that_round_trips() {
        let mut seen = std::collections::HashSet::new();
        for cmd in ALL {
            assert!(seen.insert(cmd), "{cmd} twice");
            let n = name(cmd).unwrap_or_else(|| panic!("{cmd} unnamed"));
            assert!(n.starts_with("UVM_"));
            assert_eq!(ALL.iter().copied().find(|&c| name(c) == Some(n)), Some(cmd));
        }
    }

    #[test]
    fn numbers_from_the_reference() {
        assert_eq!(INITIALIZE, 0x3000_0001);
        assert_eq!(DEINITIALIZE, 0x3000_0002);
        assert_eq!(CREATE_RANGE_GROUP, 23);
        assert_eq!(REGISTER_GPU_VASPACE, 25);
        assert_eq!(FREE, 34);
        assert_eq!(REGISTER_GPU, 37);
        assert_eq!(MM_INITIALIZE, 75);
        assert_eq!(DISCARD, 80);
        assert_eq!(name(INITIALIZE), Some("UVM_INITIALIZE"));
    }

    #[test]
    fn layouts_by_band() {
        assert_eq!(params_layout(INITIALIZE, 595), p(16, 8));
        assert_eq!(params_layout(REGISTER_GPU, 515), p(40, 36));
        assert_eq!(params_layout(FREE, 580), p(24, 16));
        assert_eq!(params_layout(FREE, 590), p(16, 8));
        assert_eq!(params_layout(MAP_EXTERNAL_ALLOCATION, 545), p(1200, 1196));
        assert_eq!(params_layout(MAP_EXTERNAL_ALLOCATION, 555), p(9264, 9260));
        assert_eq!(params_layout(MM_INITIALIZE, 530), None);
        let first_550 = DriverVersion::new(550, 40, 7);
        assert_eq!(
            params_for_version(MAP_EXTERNAL_ALLOCATION, first_550),
            p(1200, 1196)
        );
        let later_550 = DriverVersion::new(550, 40, 53);
        assert_eq!(
            params_for_version(MAP_EXTERNAL_ALLOCATION, later_550),
            p(9264, 9260)
        );
        assert_eq!(params_layout(DEINITIALIZE, 595), p_no_status(0));
    }

    /// gVisor `pkg/sentry/devices/nvproxy/version.go` (v610_43_02): "UVM range groups were removed in
    /// 610.43.02" (UVM_CREATE_RANGE_GROUP, UVM_DESTROY_RANGE_GROUP, UVM_SET_RANGE_GROUP,
    /// UVM_MIGRATE_RANGE_GROUP).
    #[test]
    fn range_groups_are_gone_from_610() {
        let v595 = DriverVersion::new(595, 45, 4);
        let v610 = DriverVersion::new(610, 43, 2);
        for cmd in [23, 24, 31, 53] {
            assert!(is_range_group(cmd));
            assert!(params_for_version(cmd, v595).is_some(), "{cmd}");
            assert_eq!(params_for_version(cmd, v610), None, "{cmd}");
            assert!(name_for(cmd, v595).is_some());
            assert_eq!(name_for(cmd, v610), None, "{cmd}");
        }
        assert_eq!(name_for(INITIALIZE, v610), Some("UVM_INITIALIZE"));
        assert_eq!(params_for_version(INITIALIZE, v610), p(16, 8));
    }

    #[test]
    fn capture_size_is_the_max_over_bands() {
        for cmd in ALL {
            let max = (500..=620)
                .filter_map(|major| params_layout(cmd, major))
                .map(|p| p.size)
                .max()
                .unwrap_or(0);
            assert_eq!(capture_size(cmd), max, "{:?}", name(cmd));
            for major in 500..=620 {
                if let Some(UvmParams {
                    size,
                    status_offset: Some(off),
                }) = params_layout(cmd, major)
                {
                    assert!(off + 4 <= size, "{:?} @{major}", name(cmd));
                }
            }
        }
        assert_eq!(capture_size(FREE), 24);
        assert_eq!(capture_size(INITIALIZE), 16);
        assert_eq!(capture_size(0xdead), 0);
    }
}
