//! The fabric's id table: slots with generations, the freed slots reused, and the
//! side table of the rare parts ([`IdExtras`]) with the accessors that hide it.

use super::{gone, Fabric, IdData, IdExtras, IdSlot, Place};
use crate::sim::types::{NodeId, SimIdKey};
use cm_core::{CmError, ConnectionParams, IdOptions};

impl Fabric {
    pub(super) fn id(&self, key: SimIdKey) -> Option<&IdData> {
        let slot = self.ids.get(key.index as usize)?;
        if slot.generation == key.generation {
            slot.data.as_ref()
        } else {
            None
        }
    }

    pub(super) fn id_mut(&mut self, key: SimIdKey) -> Option<&mut IdData> {
        let slot = self.ids.get_mut(key.index as usize)?;
        if slot.generation == key.generation {
            slot.data.as_mut()
        } else {
            None
        }
    }

    pub(super) fn live(&mut self, key: SimIdKey, op: &'static str) -> Result<&mut IdData, CmError> {
        self.id_mut(key).ok_or_else(|| gone(op))
    }

    /// The parameters the id was connected or accepted with (the default when it made
    /// neither call); `None` once destroyed.
    pub(crate) fn conn_params(&self, key: SimIdKey) -> Option<ConnectionParams> {
        self.id(key)?;
        Some(self.extras(key.index).params.unwrap_or_default())
    }

    /// What `rdma_set_option` set on the id; `None` once destroyed.
    pub(crate) fn id_options(&self, key: SimIdKey) -> Option<IdOptions> {
        self.id(key)?;
        Some(self.extras(key.index).options)
    }

    pub(crate) fn is_alive(&self, key: SimIdKey) -> bool {
        self.id(key).is_some()
    }

    pub(crate) fn create_id(&mut self, channel: usize) -> SimIdKey {
        let node = self.channels[channel].node;
        let place = Place::new(node, channel);
        let data = IdData::new(place.unwrap_or(Place::SPILLED));
        let key = if let Some(index) = self.free_ids.pop() {
            let slot = self
                .ids
                .get_mut(index as usize)
                .expect("a freed slot exists");
            slot.data = Some(data);
            SimIdKey {
                index,
                generation: slot.generation,
            }
        } else {
            self.ids.push(IdSlot {
                generation: 0,
                data: Some(data),
            });
            SimIdKey {
                index: (self.ids.len() - 1) as u32,
                generation: 0,
            }
        };
        if place.is_none() {
            self.update_extras(key.index, |extras| extras.place = Some((node, channel)));
        }
        key
    }

    /// The node and channel of id slot `index`, whose place is `place`.
    fn place_of(&self, index: u32, place: Place) -> (NodeId, usize) {
        if place == Place::SPILLED {
            if let Some(spilled) = self.extras(index).place {
                return spilled;
            }
        }
        place.get()
    }

    /// The node of id slot `index`, whose place is `place`.
    pub(super) fn node_of(&self, index: u32, place: Place) -> NodeId {
        self.place_of(index, place).0
    }

    /// The channel of id slot `index`, whose place is `place`.
    pub(super) fn channel_of(&self, index: u32, place: Place) -> usize {
        self.place_of(index, place).1
    }

    /// Moves live id `key` to `channel`, on the same node.
    pub(super) fn set_channel(&mut self, key: SimIdKey, channel: usize) {
        let Some(id) = self.id(key) else { return };
        let node = self.node_of(key.index, id.place);
        let place = Place::new(node, channel);
        if let Some(id) = self.id_mut(key) {
            id.place = place.unwrap_or(Place::SPILLED);
        }
        let spilled = place.is_none().then_some((node, channel));
        self.update_extras(key.index, |extras| extras.place = spilled);
    }

    /// A small count of id slot `index` (`compact`, its field), or the extras' `full`.
    fn count_of(compact: u8, full: impl FnOnce() -> u32) -> u32 {
        if compact == IdData::SPILLED {
            full()
        } else {
            u32::from(compact)
        }
    }

    /// The unacknowledged events of live id slot `index` (`compact`: its field).
    pub(super) fn unacked_of(&self, index: u32, compact: u8) -> u32 {
        Self::count_of(compact, || self.extras(index).unacked)
    }

    /// The retransmissions left of live id slot `index` (`compact`: its field).
    pub(super) fn retries_of(&self, index: u32, compact: u8) -> u32 {
        Self::count_of(compact, || self.extras(index).retries_left)
    }

    /// Sets a small count of live id `key`: its field (`field`) when it fits, else the
    /// extras (`full`).
    fn set_count(
        &mut self,
        key: SimIdKey,
        value: u32,
        field: fn(&mut IdData) -> &mut u8,
        full: fn(&mut IdExtras) -> &mut u32,
    ) {
        let Some(id) = self.id_mut(key) else { return };
        let compact = u8::try_from(value).ok().filter(|&v| v != IdData::SPILLED);
        let was = std::mem::replace(field(id), compact.unwrap_or(IdData::SPILLED));
        if compact.is_none() || was == IdData::SPILLED {
            let spilled = if compact.is_none() { value } else { 0 };
            self.update_extras(key.index, |extras| *full(extras) = spilled);
        }
    }

    /// One more event of live id `key` handed out (`up`), or one acknowledged.
    pub(super) fn count_unacked(&mut self, key: SimIdKey, up: bool) {
        let Some(id) = self.id_mut(key) else { return };
        // The usual case: the count stays in its field.
        if up && id.unacked < IdData::SPILLED - 1 {
            id.unacked += 1;
        } else if !up && id.unacked != IdData::SPILLED {
            id.unacked = id.unacked.saturating_sub(1);
        } else {
            let compact = id.unacked;
            let unacked = self.unacked_of(key.index, compact);
            let unacked = if up {
                unacked + 1
            } else {
                unacked.saturating_sub(1)
            };
            self.set_count(key, unacked, |id| &mut id.unacked, |e| &mut e.unacked);
        }
    }

    pub(super) fn set_retries(&mut self, key: SimIdKey, value: u32) {
        self.set_count(
            key,
            value,
            |id| &mut id.retries_left,
            |e| &mut e.retries_left,
        );
    }

    /// The rare parts of live id slot `index` (all defaults when it has none).
    pub(super) fn extras(&self, index: u32) -> IdExtras {
        if self.id_extras.is_empty() {
            return IdExtras::default();
        }
        self.id_extras.get(&index).copied().unwrap_or_default()
    }

    /// Records the port space id `key` was created in (the default takes no entry).
    pub(crate) fn set_port_space(&mut self, key: SimIdKey, space: cm_core::PortSpace) {
        if self.id(key).is_some() {
            self.update_extras(key.index, |extras| extras.options.port_space = space);
        }
    }

    /// The port space of id `key` (`Tcp` for one gone).
    pub(crate) fn port_space(&self, key: SimIdKey) -> cm_core::PortSpace {
        match self.id(key) {
            Some(_) => self.extras(key.index).options.port_space,
            None => cm_core::PortSpace::Tcp,
        }
    }

    /// Changes the rare parts of live id slot `index`; defaults take no entry.
    pub(super) fn update_extras(&mut self, index: u32, change: impl FnOnce(&mut IdExtras)) {
        let mut extras = self.extras(index);
        change(&mut extras);
        if extras != IdExtras::default() {
            self.id_extras.insert(index, extras);
        } else if !self.id_extras.is_empty() {
            self.id_extras.remove(&index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Fabric;
    use crate::sim::{NodeId, SimConfig, SimIdKey};

    /// Nodes, channels and counts too large for an id's compact fields go to its
    /// extras and come back exact; the extras empty again once they fit.
    #[test]
    fn large_id_numbers_stay_exact() {
        let mut fabric = Fabric::new(SimConfig::default(), 1);
        let nodes: Vec<NodeId> = (0..70_000)
            .map(|_| fabric.add_node(Default::default()))
            .collect();
        let far = nodes[69_999];
        let near = fabric.add_channel(nodes[1]);
        let channels: Vec<usize> = (0..66_000).map(|_| fabric.add_channel(far)).collect();
        let key = fabric.create_id(channels[65_999]);
        assert_eq!(fabric.id_node(key), Some(far));
        let id = fabric.id(key).unwrap();
        assert_eq!(fabric.channel_of(key.index, id.place), channels[65_999]);
        // A move keeps the node, whatever the channel's.
        fabric.migrate(key, near).unwrap();
        let id = fabric.id(key).unwrap();
        assert_eq!(fabric.place_of(key.index, id.place), (far, near));
        for _ in 0..70_000 {
            fabric.count_unacked(key, true);
        }
        assert_eq!(fabric.id_unacked(key), Some(70_000));
        assert!(fabric.destroy(key).is_err());
        fabric.set_retries(key, 100_000);
        let id = fabric.id(key).unwrap();
        assert_eq!(fabric.retries_of(key.index, id.retries_left), 100_000);
        fabric.set_retries(key, 3);
        let id = fabric.id(key).unwrap();
        assert_eq!(fabric.retries_of(key.index, id.retries_left), 3);
        for _ in 0..70_001 {
            fabric.count_unacked(key, false);
        }
        assert_eq!(fabric.id_unacked(key), Some(0));
        let small = fabric.create_id(near);
        assert_eq!(fabric.id_node(small), Some(nodes[1]));
        fabric.migrate(key, small_channel(&fabric, small)).unwrap();
        fabric.destroy(key).unwrap();
        assert!(fabric.id_extras.is_empty());
        // A channel past the compact field on a small node: compact again once moved.
        let last = (0..66_000).map(|_| fabric.add_channel(nodes[1])).last();
        let key = fabric.create_id(last.unwrap());
        assert_eq!(fabric.id_extras.len(), 1);
        fabric.migrate(key, near).unwrap();
        assert!(fabric.id_extras.is_empty());
        assert_eq!(small_channel(&fabric, key), near);
        assert_eq!(fabric.id_node(key), Some(nodes[1]));
    }

    fn small_channel(fabric: &Fabric, key: SimIdKey) -> usize {
        let id = fabric.id(key).unwrap();
        fabric.channel_of(key.index, id.place)
    }
}
