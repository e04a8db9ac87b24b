//! Property tests of the CSR row mapping: every operation keeps the mapping valid and the
//! logical content (the sequence of provenance ids row by row) is what the operation promises.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use mmpack_core::csr::{self, ConcatInput, PackedLayout, Selection};
use mmpack_core::intern::ProvId;
use mmpack_core::CoreError;
use proptest::prelude::*;

/// A valid value: `n_physical` segments, rows of 0..4 references, provenance drawn from a
/// small alphabet (so duplicates happen) or absent, CSR or legacy.
fn packed() -> impl Strategy<Value = PackedLayout> {
    (0usize..6, 0usize..7, any::<bool>(), any::<bool>()).prop_flat_map(
        |(n_physical, rows, legacy, with_prov)| {
            let row_lens = prop::collection::vec(0usize..4, rows);
            let refs = prop::collection::vec(0..n_physical.max(1) as i64, 0..=rows * 3);
            let prov = prop::collection::vec(0u128..4, n_physical);
            (
                Just(n_physical),
                row_lens,
                refs,
                prov,
                Just(legacy),
                Just(with_prov),
            )
                .prop_map(|(n, row_lens, refs, prov, legacy, with_prov)| {
                    let provenance = with_prov.then_some(prov);
                    if legacy {
                        return PackedLayout::legacy(n).with_provenance(provenance).unwrap();
                    }
                    let mut offsets = vec![0i64];
                    let mut indices = Vec::new();
                    let mut it = refs.into_iter().filter(|&r| (r as usize) < n);
                    for len in row_lens {
                        for _ in 0..len {
                            if let Some(r) = it.next() {
                                indices.push(r);
                            }
                        }
                        offsets.push(indices.len() as i64);
                    }
                    PackedLayout::from_csr(offsets, indices, n)
                        .and_then(|l| l.with_provenance(provenance))
                        .unwrap()
                })
        },
    )
}

/// Row `r`'s physical indices.
fn row(p: &PackedLayout, r: usize) -> Vec<usize> {
    match p.csr() {
        Some(c) => c.row(r).unwrap().iter().map(|&i| i as usize).collect(),
        None => vec![r],
    }
}

fn check_valid(p: &PackedLayout) {
    if let Some(c) = p.csr() {
        csr::validate(c.offsets(), c.indices(), p.n_physical()).unwrap();
    }
    if let Some(prov) = p.provenance() {
        assert_eq!(prov.len(), p.n_physical());
    }
}

/// A selection is compact: every output segment referenced, first references in order.
fn check_compact(sel: &Selection) {
    let c = sel.layout.csr().unwrap();
    let mut next = 0i64;
    for &i in c.indices() {
        assert!(i <= next, "first references out of order");
        if i == next {
            next += 1;
        }
    }
    assert_eq!(next as usize, sel.layout.n_physical());
    assert_eq!(sel.physical.len(), sel.layout.n_physical());
}

proptest! {
    #[test]
    fn slice_selects_rows_and_compacts(p in packed(), picks in prop::collection::vec(-8i64..8, 0..8)) {
        check_valid(&p);
        let n = p.rows() as i64;
        match p.slice(&picks) {
            Ok(sel) => {
                check_valid(&sel.layout);
                check_compact(&sel);
                prop_assert_eq!(sel.layout.rows(), picks.len());
                for (out_row, &pick) in picks.iter().enumerate() {
                    let src = (if pick < 0 { pick + n } else { pick }) as usize;
                    let got: Vec<usize> =
                        row(&sel.layout, out_row).iter().map(|&j| sel.physical[j]).collect();
                    prop_assert_eq!(got, row(&p, src));
                }
                if let (Some(a), Some(b)) = (p.provenance(), sel.layout.provenance()) {
                    for (j, &s) in sel.physical.iter().enumerate() {
                        prop_assert_eq!(b[j], a[s]);
                    }
                }
            }
            Err(CoreError::RowOutOfRange { row }) => {
                prop_assert!(row < 0 || row >= n);
                let any_bad = picks.iter().any(|&r| {
                    let r = if r < 0 { r + n } else { r };
                    r < 0 || r >= n
                });
                prop_assert!(any_bad);
            }
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }

    #[test]
    fn concat_keeps_logical_content(values in prop::collection::vec(packed(), 0..4)) {
        let inputs: Vec<ConcatInput<'_>> = values
            .iter()
            .map(|p| ConcatInput {
                layout: Some(p),
                n_physical: p.n_physical(),
            })
            .collect();
        let out = csr::concat(&inputs).unwrap();
        check_valid(&out.layout);
        let prov = out.layout.provenance().unwrap().to_vec();
        let mut sorted = prov.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), prov.len(), "output provenance is not unique");
        prop_assert_eq!(out.layout.rows(), values.iter().map(PackedLayout::rows).sum::<usize>());
        let mut out_row = 0;
        for (k, p) in values.iter().enumerate() {
            for r in 0..p.rows() {
                let got = row(&out.layout, out_row);
                let want = row(p, r);
                prop_assert_eq!(got.len(), want.len());
                for (&g, &w) in got.iter().zip(&want) {
                    match p.provenance() {
                        // Same provenance: maybe merged with an earlier segment.
                        Some(ids) => prop_assert_eq!(prov[g], ids[w]),
                        // No provenance: the very segment, never merged.
                        None => prop_assert_eq!(out.sources[g], (k, w)),
                    }
                }
                out_row += 1;
            }
        }
        let merged = csr::merge(&inputs).unwrap();
        prop_assert_eq!(merged.layout.rows(), 1);
        prop_assert_eq!(merged.layout.refs(), out.layout.refs());
    }

    #[test]
    fn repeat_and_shard_roundtrip(p in packed(), k in 0i64..4, shards in 1i64..4) {
        let rep = p.repeat_interleave(k).unwrap();
        check_valid(&rep.layout);
        check_compact(&rep);
        prop_assert_eq!(rep.layout.rows(), p.rows() * k as usize);
        let prov_out = rep.layout.provenance().unwrap().to_vec();
        for r in 0..p.rows() {
            for c in 0..k as usize {
                let got: Vec<usize> = row(&rep.layout, r * k as usize + c);
                let want = row(&p, r);
                prop_assert_eq!(got.len(), want.len());
                for (&g, &w) in got.iter().zip(&want) {
                    match p.provenance() {
                        Some(ids) => prop_assert_eq!(prov_out[g], ids[w]),
                        None => prop_assert_eq!(rep.physical[g], w),
                    }
                }
            }
        }
        match p.shard(shards) {
            Ok(parts) => {
                prop_assert_eq!(parts.len(), shards as usize);
                let mut r = 0;
                for part in &parts {
                    check_valid(&part.layout);
                    check_compact(part);
                    for pr in 0..part.layout.rows() {
                        let got: Vec<usize> =
                            row(&part.layout, pr).iter().map(|&j| part.physical[j]).collect();
                        prop_assert_eq!(got, row(&p, r));
                        r += 1;
                    }
                }
                prop_assert_eq!(r, p.rows());
            }
            Err(CoreError::ShardNotDivisible { rows, shards: s }) => {
                prop_assert_eq!(rows, p.rows());
                prop_assert!(rows % s != 0);
            }
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }

    #[test]
    fn counts_and_bytes(p in packed(), none_mask in prop::collection::vec(any::<bool>(), 6), sizes in prop::collection::vec(0u64..100, 6)) {
        let is_none = &none_mask[..p.n_physical()];
        let counts = p.logical_counts(is_none).unwrap();
        prop_assert_eq!(counts.len(), p.rows());
        for (r, &c) in counts.iter().enumerate() {
            let want = row(&p, r).iter().filter(|&&i| !is_none[i]).count() as i64;
            prop_assert_eq!(c, want);
        }
        let nbytes = &sizes[..p.n_physical()];
        let want: u64 = (0..p.rows()).flat_map(|r| row(&p, r)).map(|i| nbytes[i]).sum();
        prop_assert_eq!(p.logical_nbytes(nbytes).unwrap(), want);
    }

    #[test]
    fn validate_never_panics(offsets in prop::collection::vec(any::<i64>(), 0..6), indices in prop::collection::vec(any::<i64>(), 0..6), n in 0usize..8) {
        if csr::validate(&offsets, &indices, n).is_ok() {
            let p = PackedLayout::from_csr(offsets, indices, n).unwrap();
            let _ = p.slice(&[i64::MIN, i64::MAX, -1, 0]);
            let _ = p.repeat_interleave(i64::MAX);
            let _ = p.shard(i64::MIN);
        }
    }
}

#[test]
fn provenance_ids_roundtrip_bytes() {
    let ids: Vec<ProvId> = mmpack_core::intern::mint(3).unwrap();
    for id in ids {
        let b = mmpack_core::intern::prov_to_bytes(id);
        assert_eq!(mmpack_core::intern::prov_from_bytes(&b), Some(id));
    }
}
