//! [`DeviceMonitor`]: the kernel's announcements of RDMA devices going away (uevents),
//! for a process that has to notice a removal while it holds no CM id on the device.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use cm_core::CmError;

use crate::ffi;

/// The kernel's uevents (`NETLINK_KOBJECT_UEVENT`, its own multicast group), read for one
/// fact: an RDMA device is being removed.
///
/// Why: librdmacm keeps a device's context open as long as the device is listed, even
/// with no id on it, and closes it only when a device-list refresh
/// ([`crate::refresh_devices`]) finds the device gone. The kernel's removal of a device
/// without context disassociation (soft-RoCE among others) waits for that close, and a
/// process with no id on the device gets no CM event about it. The removal announces
/// itself, though: the device's verbs character device (`infiniband_verbs/uverbsN`) is
/// deleted before the kernel waits for the contexts, which sends a `remove` uevent.
///
/// Non-blocking; its descriptor ([`AsFd`]) goes into an event loop's wait. Receiving
/// kernel uevents needs no privilege.
#[derive(Debug)]
pub struct DeviceMonitor {
    fd: OwnedFd,
}

impl DeviceMonitor {
    /// A socket subscribed to the kernel's uevents.
    pub fn new() -> Result<DeviceMonitor, CmError> {
        // SAFETY: plain call; returns a new descriptor or -1 with errno set.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::NETLINK_KOBJECT_UEVENT,
            )
        };
        if fd < 0 {
            return Err(CmError::from_errno(
                "socket(NETLINK_KOBJECT_UEVENT)",
                ffi::last_errno(),
            ));
        }
        // SAFETY: `fd` was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain integers: all zeroes is a valid value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // Group 1: the kernel's own uevents (udev's rebroadcasts are group 2).
        addr.nl_groups = 1;
        // SAFETY: live socket; `addr` is a valid sockaddr_nl of the given size.
        let ret = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if ret != 0 {
            return Err(CmError::from_errno(
                "bind(NETLINK_KOBJECT_UEVENT)",
                ffi::last_errno(),
            ));
        }
        Ok(DeviceMonitor { fd })
    }

    /// Reads every pending uevent; whether one of them announced an RDMA device's
    /// removal (or some were lost to a full socket buffer, which may have hidden one).
    /// Never waits.
    pub fn removals(&self) -> Result<bool, CmError> {
        let mut buf = [0u8; 8192];
        let mut removal = false;
        loop {
            // SAFETY: live socket; `buf` is writable for its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                match ffi::last_errno() {
                    libc::EAGAIN | libc::EINTR => return Ok(removal),
                    // Messages were dropped: one of them may have been a removal.
                    libc::ENOBUFS => removal = true,
                    errno => return Err(CmError::from_errno("recv(uevent)", errno)),
                }
                continue;
            }
            removal |= announces_rdma_removal(&buf[..n as usize]);
        }
    }
}

/// Whether one uevent message (`ACTION@DEVPATH`, then `KEY=VALUE` fields, each
/// NUL-terminated) is the removal of an RDMA device or of its verbs character device.
pub(crate) fn announces_rdma_removal(message: &[u8]) -> bool {
    let mut fields = message.split(|&b| b == 0);
    let Some(header) = fields.next() else {
        return false;
    };
    if !header.starts_with(b"remove@") {
        return false;
    }
    fields.any(|field| field == b"SUBSYSTEM=infiniband_verbs" || field == b"SUBSYSTEM=infiniband")
}

impl AsRawFd for DeviceMonitor {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for DeviceMonitor {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rdma_removals_count() {
        let verbs = b"remove@/devices/virtual/infiniband/rxeB/infiniband_verbs/uverbs1\0ACTION=remove\0DEVPATH=/devices/virtual/infiniband/rxeB/infiniband_verbs/uverbs1\0SUBSYSTEM=infiniband_verbs\0MAJOR=231\0";
        assert!(announces_rdma_removal(verbs));
        let device =
            b"remove@/devices/virtual/infiniband/rxeB\0ACTION=remove\0SUBSYSTEM=infiniband\0";
        assert!(announces_rdma_removal(device));
        let added = b"add@/devices/virtual/infiniband/rxeB/infiniband_verbs/uverbs1\0ACTION=add\0SUBSYSTEM=infiniband_verbs\0";
        assert!(!announces_rdma_removal(added));
        let netdev = b"remove@/devices/virtual/net/vethB\0ACTION=remove\0SUBSYSTEM=net\0";
        assert!(!announces_rdma_removal(netdev));
        assert!(!announces_rdma_removal(b""));
        assert!(!announces_rdma_removal(
            b"remove@/x\0SUBSYSTEM=infiniband_verbsX\0"
        ));
    }

    #[test]
    fn a_fresh_monitor_has_nothing_to_report() {
        // Netlink sockets may be refused in a sandbox: then there is nothing to check.
        if let Ok(monitor) = DeviceMonitor::new() {
            // Whatever the host's devices do meanwhile, the read never waits.
            let _ = monitor.removals().expect("read");
        }
    }
}
