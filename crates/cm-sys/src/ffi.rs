//! The C boundary in one place: the rdma-sys items this crate uses, the declarations it
//! makes itself where rdma-sys's types would be unsound, and small helpers over libc.
//!
//! Why own declarations: rdma-sys 0.3 generates `enum ibv_event_type` as a Rust enum
//! (`rustified_enum`) that stops at `IBV_EVENT_WQ_FATAL` (19). A kernel or rdma-core newer
//! than the headers can report 20 (`DEVICE_SPEED_CHANGE`) or more, and a Rust enum holding
//! a value outside its variants is undefined behaviour. So every place where an event type
//! crosses the boundary uses a plain `u32` instead: [`RawAsyncEvent`] mirrors
//! `struct ibv_async_event`, and `rdma_notify`/`ibv_event_type_str` are declared here with
//! a `u32` parameter. `rdma_cm_event_type` is generated as a module of `u32` constants
//! (`constified_enum_module`), so `rdma_cm_event.event` is already a plain integer.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::time::Duration;

pub(crate) use rdma_sys::{
    ibv_access_flags, ibv_qp_type, ibv_send_flags, ibv_wr_opcode, rdma_port_space,
};
// Shared receive queues and their protection domain (`crate::shared`).
pub(crate) use rdma_sys::{
    ibv_ack_async_event, ibv_ack_cq_events, ibv_async_event, ibv_comp_channel, ibv_context, ibv_cq,
    ibv_create_comp_channel, ibv_create_cq, ibv_dereg_mr, ibv_destroy_comp_channel, ibv_destroy_cq,
    ibv_get_async_event, ibv_get_cq_event, ibv_get_device_name, ibv_mr, ibv_poll_cq, ibv_post_recv,
    ibv_post_send, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_init_attr, ibv_query_qp,
    ibv_recv_wr, ibv_reg_mr, ibv_req_notify_cq, ibv_send_wr, ibv_sge, ibv_srq, ibv_wc, ibv_wq,
    rdma_accept, rdma_ack_cm_event, rdma_bind_addr, rdma_cm_event, rdma_cm_id, rdma_conn_param,
    rdma_connect, rdma_create_event_channel, rdma_create_id, rdma_create_qp,
    rdma_destroy_event_channel, rdma_destroy_id, rdma_destroy_qp, rdma_disconnect,
    rdma_event_channel, rdma_event_str, rdma_free_devices, rdma_get_cm_event, rdma_get_devices,
    rdma_listen, rdma_migrate_id, rdma_reject, rdma_resolve_addr, rdma_resolve_route,
    rdma_set_option,
};
// QPs made ahead of requests (`crate::ready_qps`) and handed to an id.
pub(crate) use rdma_sys::{
    ibv_alloc_pd, ibv_create_srq, ibv_dealloc_pd, ibv_destroy_srq, ibv_device_attr, ibv_modify_srq,
    ibv_pd, ibv_post_srq_recv, ibv_query_device, ibv_srq_attr, ibv_srq_attr_mask,
    ibv_srq_init_attr,
};
pub(crate) use rdma_sys::{
    ibv_create_qp, ibv_destroy_qp, ibv_ece, ibv_modify_qp, ibv_qp_state, ibv_query_ece,
    rdma_init_qp_attr,
};

/// `union` member of [`RawAsyncEvent`]: `element` of `struct ibv_async_event`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union RawAsyncElement {
    /// `cq`, `qp`, `srq` or `wq`, depending on the event type.
    pub(crate) object: *mut c_void,
    /// `port_num`.
    pub(crate) port_num: c_int,
}

/// `struct ibv_async_event` with `event_type` as a `u32`, so that any number the kernel
/// reports can be held without undefined behaviour.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawAsyncEvent {
    /// Which object the event is about.
    pub(crate) element: RawAsyncElement,
    /// The raw `enum ibv_event_type` number.
    pub(crate) event_type: u32,
}

const _: () = {
    assert!(size_of::<RawAsyncEvent>() == size_of::<ibv_async_event>());
    assert!(align_of::<RawAsyncEvent>() == align_of::<ibv_async_event>());
    // The one field of rdma_cm_event this crate decodes must be a plain integer.
    assert!(size_of::<rdma_sys::rdma_cm_event_type::Type>() == size_of::<u32>());
};

impl RawAsyncEvent {
    /// An all-zero event (port 0, type 0), to be filled by `ibv_get_async_event`.
    pub(crate) const fn zeroed() -> Self {
        RawAsyncEvent {
            element: RawAsyncElement {
                object: std::ptr::null_mut(),
            },
            event_type: 0,
        }
    }

    /// The pointer libibverbs takes for this event.
    pub(crate) fn as_c_ptr(&mut self) -> *mut ibv_async_event {
        (self as *mut RawAsyncEvent).cast::<ibv_async_event>()
    }
}

extern "C" {
    /// `ibv_event_type_str`, taking the event number as the plain integer it is.
    #[link_name = "ibv_event_type_str"]
    fn ibv_event_type_str_raw(event: u32) -> *const c_char;

    /// `rdma_notify`, taking the event number as the plain integer it is (librdmacm sends
    /// it to the kernel unchecked).
    #[link_name = "rdma_notify"]
    pub(crate) fn rdma_notify_raw(id: *mut rdma_cm_id, event: u32) -> c_int;
}

/// The text libibverbs' own `ibv_event_type_str` gives for an event number ("unknown"
/// for numbers the installed libibverbs does not know).
pub fn libibverbs_event_str(raw: u32) -> &'static str {
    // SAFETY: ibv_event_type_str bounds-checks its argument and returns a pointer to a
    // static NUL-terminated string (never NULL); the parameter is declared as u32, so no
    // Rust enum is involved.
    let text = unsafe { CStr::from_ptr(ibv_event_type_str_raw(raw)) };
    text.to_str().unwrap_or("unknown")
}

/// The text librdmacm's own `rdma_event_str` gives for an event number ("UNKNOWN EVENT"
/// for numbers the installed librdmacm does not name).
pub fn librdmacm_event_str(raw: u32) -> &'static str {
    // SAFETY: rdma_event_str switches over its integer argument and returns a pointer to
    // a static NUL-terminated string for every value, known or not.
    let text = unsafe { CStr::from_ptr(rdma_event_str(raw)) };
    text.to_str().unwrap_or("UNKNOWN EVENT")
}

/// The text libibverbs gives for a work completion status (cm-core's `WcStatus` is
/// checked against it).
#[cfg(test)]
pub(crate) fn wc_status_str(status: u32) -> &'static str {
    // SAFETY: ibv_wc_status_str takes the status as a plain integer (rdma-sys generates
    // it as a constant module), bounds-checks it and returns a static string.
    let text = unsafe { CStr::from_ptr(rdma_sys::ibv_wc_status_str(status)) };
    text.to_str().unwrap_or("unknown")
}

/// The calling thread's errno after a failed C call; `EIO` if the call failed without
/// setting one (0 would read as success).
///
/// Read directly rather than through `std::io::Error::last_os_error`, which builds (and
/// drops) an error value on the notify path.
#[inline]
pub(crate) fn last_errno() -> i32 {
    // SAFETY: __errno_location returns the calling thread's errno slot, valid and
    // aligned for the thread's whole life.
    match unsafe { *libc::__errno_location() } {
        0 => libc::EIO,
        errno => errno,
    }
}

/// A socket address in the form librdmacm takes (`struct sockaddr *` into storage).
pub(crate) fn sockaddr_from(addr: &SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain integers; all zeroes is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
        }
    }
    storage
}

/// Decodes an IPv4 or IPv6 `struct sockaddr`; `None` for other families or unset ones.
///
/// # Safety
/// `addr` points to a readable `sockaddr_storage`-sized address (the `route.addr` members
/// of an `rdma_cm_id` are).
pub(crate) unsafe fn socket_addr_from_raw(addr: *const libc::sockaddr) -> Option<SocketAddr> {
    // SAFETY: the caller guarantees `addr` is readable; sa_family is its first field.
    let family = c_int::from(unsafe { (*addr).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in>()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6 = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in6>()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                u32::from_be(sin6.sin6_flowinfo),
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// Whether `O_NONBLOCK` is set on `fd`.
pub(crate) fn is_nonblocking(fd: RawFd) -> Result<bool, i32> {
    // SAFETY: F_GETFL only reads the flags of the descriptor; a bad fd gives EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(last_errno());
    }
    Ok(flags & libc::O_NONBLOCK != 0)
}

/// Sets or clears `O_NONBLOCK` on `fd`.
pub(crate) fn set_nonblocking(fd: RawFd, nonblocking: bool) -> Result<(), i32> {
    // SAFETY: F_GETFL only reads the flags of the descriptor; a bad fd gives EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(last_errno());
    }
    let wanted = if nonblocking {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    if wanted != flags {
        // SAFETY: F_SETFL changes only the file status flags of the descriptor.
        if unsafe { libc::fcntl(fd, libc::F_SETFL, wanted) } < 0 {
            return Err(last_errno());
        }
    }
    Ok(())
}

/// Milliseconds for librdmacm's `timeout_ms` parameters, saturated.
pub(crate) fn timeout_ms(timeout: Duration) -> c_int {
    c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_round_trip_through_sockaddr() {
        for text in ["10.77.1.1:7471", "0.0.0.0:0", "[fe80::1]:18515", "[::1]:1"] {
            let addr: SocketAddr = text.parse().unwrap();
            let storage = sockaddr_from(&addr);
            // SAFETY: `storage` is a live sockaddr_storage written by sockaddr_from.
            let back =
                unsafe { socket_addr_from_raw((&storage as *const libc::sockaddr_storage).cast()) };
            assert_eq!(back, Some(addr));
        }
    }

    #[test]
    fn librdmacm_timeouts_saturate_instead_of_wrapping_or_panicking() {
        assert_eq!(timeout_ms(Duration::MAX), c_int::MAX);
        assert_eq!(timeout_ms(Duration::from_millis(u64::MAX)), c_int::MAX);
        assert_eq!(timeout_ms(Duration::from_millis(2000)), 2000);
        assert_eq!(timeout_ms(Duration::from_micros(999)), 0);
    }

    #[test]
    fn unset_sockaddr_decodes_to_none() {
        // SAFETY: all-zero sockaddr_storage is valid (family AF_UNSPEC).
        let storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        // SAFETY: `storage` is a live sockaddr_storage.
        let addr =
            unsafe { socket_addr_from_raw((&storage as *const libc::sockaddr_storage).cast()) };
        assert_eq!(addr, None);
    }

    #[test]
    fn nonblocking_flag_toggles_and_poll_times_out_on_an_empty_pipe() {
        let mut fds = [0; 2];
        // SAFETY: a two-element array for pipe's output.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let (read_end, write_end) = (fds[0], fds[1]);
        assert_eq!(is_nonblocking(read_end), Ok(false));
        set_nonblocking(read_end, true).unwrap();
        assert_eq!(is_nonblocking(read_end), Ok(true));
        set_nonblocking(read_end, false).unwrap();
        assert_eq!(is_nonblocking(read_end), Ok(false));
        assert_eq!(
            crate::poll::wait_readable(read_end, Some(Duration::ZERO)),
            Ok(false)
        );
        // SAFETY: writes one byte from a live buffer to the pipe we own.
        let written = unsafe { libc::write(write_end, [7u8].as_ptr().cast(), 1) };
        assert_eq!(written, 1);
        assert_eq!(
            crate::poll::wait_readable(read_end, Some(Duration::from_secs(10))),
            Ok(true)
        );
        // SAFETY: closing the two descriptors this test opened.
        unsafe {
            libc::close(read_end);
            libc::close(write_end);
        }
        assert_eq!(is_nonblocking(read_end), Err(libc::EBADF));
    }
}
