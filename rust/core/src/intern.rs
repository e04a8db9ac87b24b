//! Provenance: 128-bit ids, their byte forms (one `bytes` per id, or one blob of 16 bytes per
//! id) and the interning table (first occurrence wins, deterministic order).
//!
//! A provenance id names one physical media segment. It is never derived from content or from
//! object identity: it is minted once (here, or by NeMo-RL's `uuid.uuid4().bytes`) and then
//! travels with the segment through deep copies, pickles and Ray hops, so that `concat` can
//! re-intern copies of the same segment into one physical entry.
//!
//! Minted ids are valid uuid4 byte strings. They are unique within a process (a 64-bit counter
//! pushed through a bijective mixer) and random across processes (the mixer is keyed by a
//! process key drawn from the standard library's per-process random hasher keys, the pid and
//! the clock). A forked child notices the new pid and draws a fresh key, so parent and child
//! never mint the same id.
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use rustc_hash::FxHashMap;

use crate::error::{CoreError, CoreResult};

/// One provenance id: the 16 bytes of a uuid, read big-endian.
pub type ProvId = u128;

/// Bytes of a provenance id, as Python's `uuid.UUID(...).bytes` spells it.
#[must_use]
pub fn prov_to_bytes(id: ProvId) -> [u8; 16] {
    id.to_be_bytes()
}

/// A provenance id from exactly 16 bytes; `None` for any other length.
#[must_use]
pub fn prov_from_bytes(bytes: &[u8]) -> Option<ProvId> {
    <[u8; 16]>::try_from(bytes).ok().map(u128::from_be_bytes)
}

/// Provenance entry `at` of NeMo-RL's list form (one `bytes` per segment).
///
/// # Errors
/// `ProvenanceEntry` unless `bytes` is exactly 16 bytes.
pub fn parse_id(at: usize, bytes: &[u8]) -> CoreResult<ProvId> {
    prov_from_bytes(bytes).ok_or(CoreError::ProvenanceEntry {
        at,
        len: bytes.len(),
    })
}

/// Provenance as one blob of 16 bytes per id, in order (mmpack's pickle form).
#[must_use]
pub fn encode_blob(ids: &[ProvId]) -> Vec<u8> {
    let mut blob = Vec::with_capacity(ids.len().saturating_mul(16));
    for &id in ids {
        blob.extend_from_slice(&prov_to_bytes(id));
    }
    blob
}

/// The ids of a blob made by [`encode_blob`].
///
/// # Errors
/// `ProvenanceEntry` naming the incomplete trailing entry when the length is not a multiple
/// of 16.
pub fn decode_blob(blob: &[u8]) -> CoreResult<Vec<ProvId>> {
    let chunks = blob.chunks_exact(16);
    let rest = chunks.remainder();
    if !rest.is_empty() {
        return Err(CoreError::ProvenanceEntry {
            at: blob.len() / 16,
            len: rest.len(),
        });
    }
    Ok(chunks.filter_map(prov_from_bytes).collect())
}

/// Murmur3's 64-bit finaliser: a bijection on `u64`.
const fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

struct MintState {
    pid: u32,
    key: [u64; 2],
    counter: u64,
}

static MINTER: Mutex<Option<MintState>> = Mutex::new(None);

fn fresh_key(pid: u32) -> [u64; 2] {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut key = [0u64; 2];
    for (i, slot) in key.iter_mut().enumerate() {
        // Each `RandomState::new()` carries fresh per-process random keys.
        let mut h = RandomState::new().build_hasher();
        h.write_u128(nanos);
        h.write_u32(pid);
        h.write_usize(i);
        h.write_usize(std::ptr::from_ref(slot) as usize);
        *slot = h.finish();
    }
    key
}

/// Reserve `n` consecutive counter values under the current process key.
fn reserve(n: usize) -> CoreResult<([u64; 2], u64)> {
    let n = u64::try_from(n).map_err(|_| CoreError::IndexOverflow {
        what: "the number of provenance ids to mint",
    })?;
    let pid = std::process::id();
    let mut guard = MINTER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let state = match guard.as_mut() {
        Some(state) if state.pid == pid => state,
        _ => guard.insert(MintState {
            pid,
            key: fresh_key(pid),
            counter: 0,
        }),
    };
    let start = state.counter;
    state.counter = start.checked_add(n).ok_or(CoreError::IndexOverflow {
        what: "the provenance counter",
    })?;
    Ok((state.key, start))
}

/// The uuid4 id for counter value `c` under `key`.
///
/// `u = fmix64(c + key0)` is a bijection of `c`, and its 64 bits sit in the 64 bits of a uuid4
/// that carry no version/variant bits (byte 7 and bytes 9..16), so distinct counters give
/// distinct ids. The remaining free bits are filled from `u` and the second key.
fn id_for(key: [u64; 2], c: u64) -> ProvId {
    let u = fmix64(c.wrapping_add(key[0]));
    let r = fmix64(u ^ key[1]);
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&r.to_be_bytes()[..6]);
    let [_, _, _, _, _, _, r6, r7] = r.to_be_bytes();
    b[6] = 0x40 | (r6 & 0x0f);
    let ub = u.to_be_bytes();
    b[7] = ub[0];
    b[8] = 0x80 | (r7 & 0x3f);
    b[9..].copy_from_slice(&ub[1..]);
    u128::from_be_bytes(b)
}

/// Mint `n` fresh provenance ids (valid uuid4 bytes), unique within the process.
///
/// # Errors
/// `IndexOverflow` if the process counter would pass `u64::MAX`.
pub fn mint(n: usize) -> CoreResult<Vec<ProvId>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let (key, start) = reserve(n)?;
    let mut out = Vec::with_capacity(n);
    let mut c = start;
    for _ in 0..n {
        out.push(id_for(key, c));
        c = c.wrapping_add(1);
    }
    Ok(out)
}

/// Interning table from provenance id to output physical index: first occurrence wins and
/// output indices are handed out in first-seen order.
#[derive(Debug, Default)]
pub struct Interner {
    map: FxHashMap<ProvId, usize>,
    ids: Vec<ProvId>,
}

impl Interner {
    /// An empty table with room for `capacity` ids.
    #[must_use]
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            map: FxHashMap::with_capacity_and_hasher(capacity, rustc_hash::FxBuildHasher),
            ids: Vec::with_capacity(capacity),
        }
    }

    /// The output index of `id` and whether it was new (`true`: the caller keeps its segment).
    pub fn intern(&mut self, id: ProvId) -> (usize, bool) {
        let next = self.ids.len();
        match self.map.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => (*e.get(), false),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(next);
                self.ids.push(id);
                (next, true)
            }
        }
    }

    /// Add `id` as a new entry without looking it up (a freshly minted id is never seen).
    pub fn push_fresh(&mut self, id: ProvId) -> usize {
        let next = self.ids.len();
        self.map.insert(id, next);
        self.ids.push(id);
        next
    }

    /// Number of distinct ids.
    #[must_use]
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether no id was interned.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The distinct ids in first-seen order.
    #[must_use]
    pub fn into_ids(self) -> Vec<ProvId> {
        self.ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_ids_are_uuid4_and_unique() {
        let ids = mint(10_000).unwrap_or_default();
        assert_eq!(ids.len(), 10_000);
        let mut seen = rustc_hash::FxHashSet::default();
        for id in &ids {
            let b = prov_to_bytes(*id);
            assert_eq!(b[6] >> 4, 4);
            assert_eq!(b[8] >> 6, 0b10);
            assert!(seen.insert(*id));
            assert_eq!(prov_from_bytes(&b), Some(*id));
        }
        let more = mint(5).unwrap_or_default();
        assert!(more.iter().all(|id| !seen.contains(id)));
    }

    #[test]
    fn interner_first_wins() {
        let mut t = Interner::with_capacity(4);
        assert_eq!(t.intern(7), (0, true));
        assert_eq!(t.intern(9), (1, true));
        assert_eq!(t.intern(7), (0, false));
        assert_eq!(t.len(), 2);
        assert_eq!(t.into_ids(), vec![7, 9]);
    }

    #[test]
    fn blob_roundtrips_and_names_a_torn_entry() {
        let ids = mint(3).unwrap_or_default();
        let blob = encode_blob(&ids);
        assert_eq!(blob.len(), 48);
        assert_eq!(&blob[16..32], &prov_to_bytes(ids[1]));
        assert_eq!(decode_blob(&blob), Ok(ids));
        assert_eq!(decode_blob(&[]), Ok(Vec::new()));
        assert_eq!(encode_blob(&[]), Vec::<u8>::new());
        assert_eq!(
            decode_blob(&blob[..40]),
            Err(CoreError::ProvenanceEntry { at: 2, len: 8 })
        );
        assert_eq!(parse_id(0, &blob[..16]).ok(), prov_from_bytes(&blob[..16]));
        assert_eq!(
            parse_id(4, &[1, 2]),
            Err(CoreError::ProvenanceEntry { at: 4, len: 2 })
        );
    }

    #[test]
    fn wrong_length_bytes_rejected() {
        assert_eq!(prov_from_bytes(&[0u8; 15]), None);
        assert_eq!(prov_from_bytes(&[0u8; 17]), None);
    }
}
