//! Behaviour that needs no RDMA device: the no-device error, the ABI numbers against
//! libc, and cm-core's strings against the installed C libraries' own.

use std::path::Path;

use cm_core::{errno, AsyncEventType, CmEventType};
use cm_sys::{libibverbs_event_str, librdmacm_event_str, EventChannel};

/// Whether the kernel exposes an RDMA CM and at least one RDMA device.
fn rdma_device_present() -> bool {
    Path::new("/dev/infiniband/rdma_cm").exists()
        && std::fs::read_dir("/sys/class/infiniband")
            .map(|mut entries| entries.next().is_some())
            .unwrap_or(false)
}

#[test]
fn creating_a_channel_without_a_device_is_the_typed_no_device_error() {
    match EventChannel::new() {
        Ok(channel) => {
            assert!(
                rdma_device_present(),
                "a channel opened although no RDMA device exists: {channel:?}"
            );
        }
        Err(error) => {
            assert!(
                !rdma_device_present(),
                "an RDMA device exists but the channel failed: {error}"
            );
            assert!(error.is_no_device(), "not the no-device error: {error:?}");
            assert!(
                [errno::ENODEV, errno::EPERM, errno::ENOENT].contains(&error.errno()),
                "unexpected errno: {error:?}"
            );
            assert!(error.to_string().contains("no RDMA device"), "{error}");
        }
    }
}

#[test]
fn creating_channels_repeatedly_never_panics_and_answers_the_same() {
    let first = EventChannel::new().map(|_| ()).map_err(|e| e.errno());
    for _ in 0..5 {
        assert_eq!(
            EventChannel::new().map(|_| ()).map_err(|e| e.errno()),
            first
        );
    }
}

#[test]
fn cm_core_errno_constants_are_libc_s() {
    let pairs = [
        (errno::EPERM, libc::EPERM),
        (errno::ENOENT, libc::ENOENT),
        (errno::ENXIO, libc::ENXIO),
        (errno::EAGAIN, libc::EAGAIN),
        (errno::ENOMEM, libc::ENOMEM),
        (errno::EBUSY, libc::EBUSY),
        (errno::ENODEV, libc::ENODEV),
        (errno::EINVAL, libc::EINVAL),
        (errno::ENODATA, libc::ENODATA),
        (errno::EOPNOTSUPP, libc::EOPNOTSUPP),
        (errno::EISCONN, libc::EISCONN),
        (errno::ETIMEDOUT, libc::ETIMEDOUT),
    ];
    for (ours, libc_value) in pairs {
        assert_eq!(ours, libc_value, "{:?}", errno::name(ours));
    }
}

#[test]
fn async_event_strings_equal_ibv_event_type_str_for_every_known_value() {
    let mut known_by_c = 0;
    for raw in 0..64u32 {
        let c_text = libibverbs_event_str(raw);
        let ours = AsyncEventType::from_raw(raw);
        if c_text == "unknown" {
            // The installed libibverbs does not know this number: cm-core may (20 is
            // DEVICE_SPEED_CHANGE, newer than rdma-core 44), but only beyond the C range.
            assert!(raw as usize >= known_by_c, "gap at {raw}");
            continue;
        }
        assert_eq!(raw as usize, known_by_c, "gap before {raw}");
        known_by_c += 1;
        assert_eq!(ours.to_string(), c_text, "ibv_event_type {raw}");
        assert_eq!(ours.libibverbs_str(), c_text, "ibv_event_type {raw}");
    }
    // rdma-core 44 names 0..=19 (WQ_FATAL); newer ones 0..=20.
    assert!(
        known_by_c >= 20,
        "only {known_by_c} values known by libibverbs"
    );
    assert_eq!(libibverbs_event_str(u32::MAX), "unknown");
}

#[test]
fn cm_event_strings_equal_rdma_event_str_for_every_value_it_names() {
    let mut named_by_c = 0;
    for raw in 0..64u32 {
        let c_text = librdmacm_event_str(raw);
        let ours = CmEventType::from_raw(raw);
        if c_text == "UNKNOWN EVENT" {
            // Either librdmacm hides the value too (USER, INTERNAL, unknown numbers), or
            // the installed librdmacm predates it: rdma-core 44 names 0..=15 and not
            // ADDRINFO_RESOLVED/ADDRINFO_ERROR (16, 17), which later versions added.
            assert!(
                ours.librdmacm_str() == c_text || raw as usize >= named_by_c,
                "rdma_cm_event_type {raw}: C hides it, cm-core prints {ours}"
            );
            continue;
        }
        assert_eq!(raw as usize, named_by_c, "gap before {raw}");
        named_by_c += 1;
        assert_eq!(ours.to_string(), c_text, "rdma_cm_event_type {raw}");
        assert_eq!(ours.librdmacm_str(), c_text, "rdma_cm_event_type {raw}");
    }
    // ADDR_RESOLVED..TIMEWAIT_EXIT at least (rdma-core 44).
    assert!(
        named_by_c >= 16,
        "only {named_by_c} values named by librdmacm"
    );
    for hidden in [
        CmEventType::User,
        CmEventType::Internal,
        CmEventType::Unknown(u32::MAX),
    ] {
        assert_eq!(librdmacm_event_str(hidden.as_raw()), "UNKNOWN EVENT");
        assert_eq!(hidden.librdmacm_str(), "UNKNOWN EVENT");
    }
}
