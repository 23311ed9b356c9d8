//! The allocation or free an RM call named when it entered the kernel, from the fields the probes read at
//! `sys_enter_ioctl` (before the driver's copy-in), for the ledger to compare with what the params say at
//! the exit (after the driver's copy-out), which another thread of the caller may have rewritten meanwhile.
use super::Op;
use crate::{class, escape, params};

/// What the probes read at an RM call's entry (`baton_probe_common::EnterReading`, field for field).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EnterFields {
    /// The escape read (the inner one of an IOCTL_XFER_CMD); 0: nothing was read.
    pub nr: u32,
    /// Bytes of its params struct read.
    pub len: u32,
    /// hRoot.
    pub client: u32,
    /// hObjectParent.
    pub parent: u32,
    /// hObjectNew, hObjectOld or hMemory.
    pub object: u32,
    /// hClass, or RM_VID_HEAP_CONTROL's function.
    pub class: u32,
    /// The raw size field (memory-allocation params' size, NVOS02's limit, NVOS32's AllocSize.size), when
    /// read.
    pub size: Option<u64>,
}

/// The operation `e` names, as the exit's decoder would name the same params: `None` when nothing (or too
/// little of the struct) was read, or the escape allocates and frees nothing.
pub fn op_at_enter(e: &EnterFields) -> Option<Op> {
    let need = match e.nr {
        escape::RM_ALLOC => params::rm_alloc::P_ALLOC_PARMS_OFFSET,
        escape::RM_ALLOC_OBJECT => params::nvos05::STATUS_OFFSET,
        escape::RM_FREE => params::nvos00::STATUS_OFFSET,
        escape::RM_ALLOC_MEMORY => params::nvos02::STATUS_OFFSET,
        escape::RM_VID_HEAP_CONTROL => params::nvos32::ALLOC_SIZE_OFFSET + 8,
        _ => return None,
    };
    if e.len < need {
        return None;
    }
    let (client, parent, object, class) = (e.client, e.parent, e.object, e.class);
    Some(match e.nr {
        escape::RM_ALLOC => Op::Alloc {
            client,
            parent,
            object,
            class,
            size: e.size.filter(|_| class::is_memory(class)),
        },
        escape::RM_ALLOC_OBJECT => Op::Alloc {
            client,
            parent,
            object,
            class,
            size: None,
        },
        escape::RM_FREE => Op::Free {
            client,
            parent,
            object,
        },
        escape::RM_ALLOC_MEMORY => Op::AllocMemory {
            client,
            parent,
            object,
            class,
            size: e.size?.saturating_add(1),
        },
        _ => match class {
            params::nvos32::FUNCTION_ALLOC_SIZE => Op::VidHeapAlloc {
                client,
                parent,
                object,
                size: e.size?,
            },
            params::nvos32::FUNCTION_FREE => Op::VidHeapFree {
                client,
                parent,
                object,
            },
            _ => Op::Other,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(nr: u32, len: u32, class: u32, size: Option<u64>) -> EnterFields {
        EnterFields {
            nr,
            len,
            client: 0xc1,
            parent: 0xd0,
            object: 0xe0,
            class,
            size,
        }
    }

    #[test]
    fn each_escape_names_the_operation_the_exit_decoder_would() {
        let alloc = fields(
            escape::RM_ALLOC,
            32,
            class::NV01_MEMORY_LOCAL_USER,
            Some(4096),
        );
        assert_eq!(
            op_at_enter(&alloc),
            Some(Op::Alloc {
                client: 0xc1,
                parent: 0xd0,
                object: 0xe0,
                class: class::NV01_MEMORY_LOCAL_USER,
                size: Some(4096)
            })
        );
        let device = fields(escape::RM_ALLOC, 32, class::NV01_DEVICE_0, Some(4096));
        assert!(matches!(
            op_at_enter(&device),
            Some(Op::Alloc { size: None, .. })
        ));
        let memory = fields(
            escape::RM_ALLOC_MEMORY,
            56,
            class::NV01_MEMORY_SYSTEM,
            Some(4095),
        );
        assert!(matches!(
            op_at_enter(&memory),
            Some(Op::AllocMemory { size: 4096, .. })
        ));
        let heap = fields(
            escape::RM_VID_HEAP_CONTROL,
            96,
            params::nvos32::FUNCTION_ALLOC_SIZE,
            Some(1 << 20),
        );
        assert!(matches!(
            op_at_enter(&heap),
            Some(Op::VidHeapAlloc { size: 1048576, .. })
        ));
        let heap_free = fields(
            escape::RM_VID_HEAP_CONTROL,
            96,
            params::nvos32::FUNCTION_FREE,
            Some(0),
        );
        assert!(matches!(
            op_at_enter(&heap_free),
            Some(Op::VidHeapFree { object: 0xe0, .. })
        ));
        assert!(matches!(
            op_at_enter(&fields(escape::RM_FREE, 16, 0, None)),
            Some(Op::Free { object: 0xe0, .. })
        ));
    }

    #[test]
    fn nothing_read_or_too_little_names_nothing() {
        assert_eq!(op_at_enter(&EnterFields::default()), None);
        assert_eq!(op_at_enter(&fields(escape::RM_FREE, 8, 0, None)), None);
        assert_eq!(op_at_enter(&fields(escape::RM_CONTROL, 32, 0, None)), None);
        assert_eq!(
            op_at_enter(&fields(escape::RM_ALLOC_MEMORY, 56, 0x3e, None)),
            None,
            "an NVOS02 whose limit was not read"
        );
    }
}
