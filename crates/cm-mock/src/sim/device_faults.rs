//! What happens to a node's device from outside: removal, an address change, a QP
//! budget (the pinned-memory limit), the device going away.

use cm_core::{CmError, CmEventType};

use super::SimNode;

impl SimNode {
    /// Removes the node's device, as `rdma link delete` does: every id bound to it gets
    /// a DEVICE_REMOVAL event, and notify answers ENODEV from now on. Returns how many
    /// ids were told.
    pub fn remove_device(&self) -> Result<usize, CmError> {
        self.fabric.lock().remove_device(self.id)
    }

    /// The address under the node's device moved to another hardware port, as a bond
    /// failing over does: every id bound to the device gets an ADDR_CHANGE event (the
    /// kernel's `cma_netdev_callback`), and nothing else changes: connections stay up.
    /// Returns how many ids were told.
    pub fn change_address(&self) -> usize {
        self.fabric
            .lock()
            .tell_device_ids(self.id, CmEventType::AddrChange)
    }

    /// Lets the node create at most `budget` more QPs (`None`: no limit); past it
    /// `rdma_create_qp` answers ENOMEM, as the kernel does once the pinned memory of a
    /// process passes RLIMIT_MEMLOCK.
    pub fn set_qp_budget(&self, budget: Option<u32>) -> Result<(), CmError> {
        self.fabric.lock().set_qp_budget(self.id, budget)
    }

    /// Marks the device as going away (notify(COMM_EST) then answers ENODEV) or back.
    pub fn set_going_down(&self, going_down: bool) -> Result<(), CmError> {
        self.fabric.lock().set_going_down(self.id, going_down)
    }
}
