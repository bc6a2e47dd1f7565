//! A reader of fuzzer bytes that never fails: an exhausted input reads as zeroes, so
//! every byte string is a valid test case.

/// Fuzzer bytes, consumed from the front.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// Reads `data` from the start.
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// Whether every byte was consumed.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The next `N` bytes, zero-padded when the input runs out.
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let take = N.min(self.data.len());
        out[..take].copy_from_slice(&self.data[..take]);
        self.data = &self.data[take..];
        out
    }

    /// One byte.
    pub fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }

    /// A little-endian i32.
    pub fn i32(&mut self) -> i32 {
        i32::from_le_bytes(self.bytes())
    }

    /// One bit of one byte.
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// A number in `0..bound` (`bound` > 0).
    pub fn below(&mut self, bound: usize) -> usize {
        usize::from(self.u8()) % bound
    }

    /// Up to `max` of the remaining bytes.
    pub fn slice(&mut self, max: usize) -> &'a [u8] {
        let take = max.min(self.data.len());
        let (head, tail) = self.data.split_at(take);
        self.data = tail;
        head
    }
}
