//! The fixed file tree the mock driver serves: one inode per device node (`nvidiactl`, `nvidia0`..,
//! `nvidia-uvm`, `nvidia-uvm-tools`) plus the read-only `version` and `state.json` files.

use std::time::{Duration, SystemTime};

use fuser::{FileAttr, FileType, INodeNo};

/// Inode of the mount's root directory (FUSE reserves 1 for it).
pub const ROOT_INO: u64 = 1;
const CTL_INO: u64 = 2;
const UVM_INO: u64 = 3;
const UVM_TOOLS_INO: u64 = 4;
const VERSION_INO: u64 = 5;
const STATE_INO: u64 = 6;
const FIRST_GPU_INO: u64 = 16;

/// How long the kernel may cache names and attributes: the tree never changes while mounted.
pub const ATTR_TTL: Duration = Duration::from_secs(60);

/// What a file of the mount stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Node {
    /// `/dev/nvidiactl`: the control node that RM clients allocate through.
    Ctl,
    /// `/dev/nvidiaN`: one per GPU.
    Gpu(u32),
    /// `/dev/nvidia-uvm`.
    Uvm,
    /// `/dev/nvidia-uvm-tools`.
    UvmTools,
    /// Text like `/proc/driver/nvidia/version`.
    Version,
    /// JSON dump of the mock's state, for assertions from any process.
    State,
}

impl Node {
    /// The file's name in the mount.
    pub fn name(self) -> String {
        match self {
            Node::Ctl => "nvidiactl".to_owned(),
            Node::Gpu(index) => format!("nvidia{index}"),
            Node::Uvm => "nvidia-uvm".to_owned(),
            Node::UvmTools => "nvidia-uvm-tools".to_owned(),
            Node::Version => "version".to_owned(),
            Node::State => "state.json".to_owned(),
        }
    }

    /// The inode number the mount uses for this file.
    pub fn ino(self) -> u64 {
        match self {
            Node::Ctl => CTL_INO,
            Node::Uvm => UVM_INO,
            Node::UvmTools => UVM_TOOLS_INO,
            Node::Version => VERSION_INO,
            Node::State => STATE_INO,
            Node::Gpu(index) => FIRST_GPU_INO + u64::from(index),
        }
    }

    /// Whether this file stands for a device node (ioctl and mmap target) rather than a text file.
    pub fn is_device(self) -> bool {
        !matches!(self, Node::Version | Node::State)
    }
}

/// The whole tree for a mock with `gpus` GPUs.
#[derive(Debug, Clone)]
pub struct Tree {
    gpus: u32,
    device_size: u64,
    created: SystemTime,
}

impl Tree {
    /// A tree with `gpus` GPU nodes whose device files are `device_size` bytes long (the mmap window).
    pub fn new(gpus: u32, device_size: u64) -> Self {
        Self {
            gpus,
            device_size,
            created: SystemTime::now(),
        }
    }

    /// Every file of the root directory, in listing order.
    pub fn nodes(&self) -> Vec<Node> {
        let mut nodes = vec![Node::Ctl];
        nodes.extend((0..self.gpus).map(Node::Gpu));
        nodes.extend([Node::Uvm, Node::UvmTools, Node::Version, Node::State]);
        nodes
    }

    /// The file with this name, if the tree has one.
    pub fn by_name(&self, name: &str) -> Option<Node> {
        self.nodes().into_iter().find(|node| node.name() == name)
    }

    /// The file with this inode, if the tree has one.
    pub fn by_ino(&self, ino: INodeNo) -> Option<Node> {
        self.nodes().into_iter().find(|node| node.ino() == ino.0)
    }

    /// Attributes of the root directory.
    pub fn root_attr(&self) -> FileAttr {
        self.attr(ROOT_INO, FileType::Directory, 0o755, 0)
    }

    /// Attributes of a file. Device files are world read-write like `/dev/nvidia*` and as long as the mmap
    /// window, so `mmap(MAP_SHARED)` inside it works through the page cache; text files report size 0 and
    /// are served with direct I/O, so every read sees fresh content.
    pub fn node_attr(&self, node: Node) -> FileAttr {
        if node.is_device() {
            self.attr(node.ino(), FileType::RegularFile, 0o666, self.device_size)
        } else {
            self.attr(node.ino(), FileType::RegularFile, 0o444, 0)
        }
    }

    fn attr(&self, ino: u64, kind: FileType, perm: u16, size: u64) -> FileAttr {
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.created,
            mtime: self.created,
            ctime: self.created,
            crtime: self.created,
            kind,
            perm,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_inodes_round_trip() {
        let tree = Tree::new(2, 4096);
        let names: Vec<String> = tree.nodes().into_iter().map(Node::name).collect();
        assert_eq!(
            names,
            [
                "nvidiactl",
                "nvidia0",
                "nvidia1",
                "nvidia-uvm",
                "nvidia-uvm-tools",
                "version",
                "state.json"
            ]
        );
        for node in tree.nodes() {
            assert_eq!(tree.by_name(&node.name()), Some(node));
            assert_eq!(tree.by_ino(INodeNo(node.ino())), Some(node));
        }
        assert_eq!(tree.by_name("nvidia2"), None);
    }
}
