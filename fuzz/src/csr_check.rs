//! CSR validation, slice, shard, repeat, concat / merge and provenance interning, checked
//! against a plain model: every row of a result references the same source segments (or
//! provenance ids) as the rows it was built from.
use std::collections::HashSet;

use mmpack_core::csr::{
    concat, concat_values, merge, validate, Concat, ConcatInput, ConcatMode, ConcatOutcome,
    PackedLayout, Selection,
};
use mmpack_core::intern::{mint, prov_from_bytes, prov_to_bytes, ProvId};
use mmpack_core::payload::{logical_totals, measure, SeenSegments, Segment};
use mmpack_core::CoreError;

use crate::bytes::Bytes;

/// Which rule `validate` must report first, from a direct reading of the rules.
fn model_validate(offsets: &[i64], indices: &[i64], n_physical: usize) -> Option<u8> {
    if offsets.first() != Some(&0) {
        return Some(0);
    }
    if offsets.windows(2).any(|w| w[1] < w[0]) {
        return Some(1);
    }
    if offsets.last().map(|&l| i128::from(l)) != Some(indices.len() as i128) {
        return Some(2);
    }
    if indices
        .iter()
        .any(|&i| i < 0 || i128::from(i) >= n_physical as i128)
    {
        return Some(3);
    }
    None
}

fn kind(e: &CoreError) -> u8 {
    match e {
        CoreError::OffsetsStart => 0,
        CoreError::OffsetsDecreasing { .. } => 1,
        CoreError::OffsetsEnd { .. } => 2,
        CoreError::SegmentIndexOutOfRange { .. } => 3,
        _ => 9,
    }
}

/// Raw offsets and indices (`None`: the legacy layout), valid or not.
fn gen_csr(b: &mut Bytes<'_>, n_physical: usize) -> Option<(Vec<i64>, Vec<i64>)> {
    let mode = b.u8();
    match mode % 4 {
        0 => None,
        1 => {
            let len = b.below(6);
            let offsets = (0..len).map(|_| b.wild(-2, 10)).collect();
            let len = b.below(10);
            let indices = (0..len).map(|_| b.wild(-2, 10)).collect();
            Some((offsets, indices))
        }
        _ => {
            let rows = b.below(8);
            let mut offsets = vec![0i64];
            let mut indices = Vec::new();
            for _ in 0..rows {
                for _ in 0..b.below(4) {
                    indices.push(b.below(n_physical.max(1)) as i64);
                }
                offsets.push(indices.len() as i64);
            }
            if mode & 0x80 != 0 {
                // Corrupt one entry.
                let v = b.wild(-2, 10);
                if b.flag() && !offsets.is_empty() {
                    let at = b.below(offsets.len());
                    offsets[at] = v;
                } else if !indices.is_empty() {
                    let at = b.below(indices.len());
                    indices[at] = v;
                }
            }
            Some((offsets, indices))
        }
    }
}

fn gen_prov(b: &mut Bytes<'_>, n_physical: usize) -> Option<Vec<ProvId>> {
    match b.u8() % 4 {
        0 => None,
        3 => Some((0..b.below(9)).map(|_| ProvId::from(b.u8() % 4)).collect()),
        _ => Some((0..n_physical).map(|_| ProvId::from(b.u8() % 5)).collect()),
    }
}

/// A mapping from the input, or `None` when the constructors refused it (they must refuse
/// exactly the mappings that break a rule, and keep the others as given).
fn gen_packed(b: &mut Bytes<'_>) -> Option<PackedLayout> {
    let n_physical = b.below(9);
    let csr = gen_csr(b, n_physical);
    let provenance = gen_prov(b, n_physical);
    let mut valid = provenance.as_ref().is_none_or(|p| p.len() == n_physical);
    if let Some((offsets, indices)) = &csr {
        let got = validate(offsets, indices, n_physical);
        let want = model_validate(offsets, indices, n_physical);
        assert_eq!(
            got.as_ref().err().map(kind),
            want,
            "validate {offsets:?} {indices:?} n={n_physical}"
        );
        valid &= want.is_none();
    }
    let built = match csr.clone() {
        Some((offsets, indices)) => PackedLayout::from_csr(offsets, indices, n_physical),
        None => Ok(PackedLayout::legacy(n_physical)),
    }
    .and_then(|l| l.with_provenance(provenance.clone()));
    assert_eq!(built.is_ok(), valid, "constructors disagree with the rules");
    let p = built.ok()?;
    assert_eq!(p.n_physical(), n_physical);
    assert_eq!(p.provenance(), provenance.as_deref());
    let raw = p
        .csr()
        .map(|c| (c.offsets().to_vec(), c.indices().to_vec()));
    assert_eq!(raw, csr);
    Some(p)
}

/// Rows of a valid mapping as lists of physical segment indices.
fn logical(p: &PackedLayout) -> Vec<Vec<usize>> {
    match p.csr() {
        None => (0..p.n_physical()).map(|r| vec![r]).collect(),
        Some(c) => (0..c.rows())
            .map(|r| {
                c.row(r)
                    .unwrap_or(&[])
                    .iter()
                    .map(|&i| usize::try_from(i).unwrap_or(usize::MAX))
                    .collect()
            })
            .collect(),
    }
}

fn assert_valid(p: &PackedLayout) {
    if let Some(c) = p.csr() {
        let ok = validate(c.offsets(), c.indices(), p.n_physical());
        assert!(ok.is_ok(), "result is not a valid mapping: {p:?}");
    }
    if let Some(prov) = p.provenance() {
        assert_eq!(prov.len(), p.n_physical(), "provenance does not fit: {p:?}");
    }
}

/// A selection of `rows` of `orig`: same references through `physical`, compacted in
/// first-reference order, provenance carried along.
fn check_selection(orig: &PackedLayout, sel: &Selection, rows: &[usize]) {
    assert_valid(&sel.layout);
    assert!(sel.layout.is_csr());
    assert_eq!(sel.physical.len(), sel.layout.n_physical());
    let distinct: HashSet<usize> = sel.physical.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        sel.physical.len(),
        "physical repeats a source"
    );
    assert!(sel.physical.iter().all(|&s| s < orig.n_physical()));
    match orig.provenance() {
        Some(p) => {
            let want: Vec<ProvId> = sel.physical.iter().map(|&s| p[s]).collect();
            assert_eq!(sel.layout.provenance(), Some(&want[..]));
        }
        None => assert_eq!(sel.layout.provenance(), None),
    }
    let mut next = 0usize;
    if let Some(c) = sel.layout.csr() {
        for &i in c.indices() {
            let i = usize::try_from(i).unwrap_or(usize::MAX);
            assert!(i <= next, "not in first-reference order");
            if i == next {
                next += 1;
            }
        }
    }
    assert_eq!(
        next,
        sel.layout.n_physical(),
        "an unreferenced physical segment"
    );
    let orig_rows = logical(orig);
    let got: Vec<Vec<usize>> = logical(&sel.layout)
        .iter()
        .map(|r| r.iter().map(|&i| sel.physical[i]).collect())
        .collect();
    let want: Vec<Vec<usize>> = rows.iter().map(|&r| orig_rows[r].clone()).collect();
    assert_eq!(got, want);
}

fn check_repeat(orig: &PackedLayout, k: i64) {
    // Results past a few million references are legitimate but too big to build here.
    let refs = (orig.rows().max(orig.refs()) as i128) * i128::from(k);
    if refs > 1 << 22 && refs < 1 << 40 {
        return;
    }
    let res = orig.repeat_interleave(k);
    let Ok(ku) = usize::try_from(k) else {
        assert_eq!(res, Err(CoreError::Repeats { repeats: k }));
        return;
    };
    let sel = match res {
        Ok(s) => s,
        Err(CoreError::RepeatsTooLarge { repeats, .. }) if refs >= 1 << 40 && repeats == k => {
            return
        }
        Err(e) => {
            unreachable!("repeat_interleave({k}) failed on a valid mapping: {e}");
        }
    };
    assert_valid(&sel.layout);
    assert_eq!(sel.physical.len(), sel.layout.n_physical());
    let key = |s: usize| -> (bool, ProvId) {
        match orig.provenance() {
            Some(p) => (true, p[s]),
            None => (false, s as ProvId),
        }
    };
    let keys: Vec<(bool, ProvId)> = sel.physical.iter().map(|&s| key(s)).collect();
    let distinct: HashSet<(bool, ProvId)> = keys.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        keys.len(),
        "repeat kept two copies of one provenance"
    );
    let out_prov = sel.layout.provenance().unwrap_or_default().to_vec();
    assert_eq!(out_prov.len(), sel.layout.n_physical());
    let distinct: HashSet<ProvId> = out_prov.iter().copied().collect();
    assert_eq!(distinct.len(), out_prov.len());
    if let Some(p) = orig.provenance() {
        let want: Vec<ProvId> = sel.physical.iter().map(|&s| p[s]).collect();
        assert_eq!(out_prov, want);
    }
    let orig_rows = logical(orig);
    let got: Vec<Vec<(bool, ProvId)>> = logical(&sel.layout)
        .iter()
        .map(|r| r.iter().map(|&i| keys[i]).collect())
        .collect();
    let mut want = Vec::new();
    for row in &orig_rows {
        for _ in 0..ku {
            want.push(row.iter().map(|&s| key(s)).collect::<Vec<_>>());
        }
    }
    assert_eq!(got, want);
}

fn check_concat(inputs: &[PackedLayout]) {
    let ci: Vec<ConcatInput<'_>> = inputs
        .iter()
        .map(|p| ConcatInput {
            layout: Some(p),
            n_physical: p.n_physical(),
        })
        .collect();
    let c = match concat(&ci) {
        Ok(c) => c,
        Err(e) => {
            unreachable!("concat of valid inputs failed: {e}");
        }
    };
    assert_valid(&c.layout);
    let key = |k: usize, s: usize| -> (bool, ProvId) {
        match inputs[k].provenance() {
            Some(p) => (true, p[s]),
            None => (false, ((k as ProvId) << 32) | s as ProvId),
        }
    };
    assert_eq!(c.sources.len(), c.layout.n_physical());
    assert!(
        c.sources.windows(2).all(|w| w[0] < w[1]),
        "sources out of order"
    );
    let keys: Vec<(bool, ProvId)> = c.sources.iter().map(|&(k, s)| key(k, s)).collect();
    let distinct: HashSet<(bool, ProvId)> = keys.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        keys.len(),
        "concat kept two copies of one provenance"
    );
    let mut every = HashSet::new();
    for (k, p) in inputs.iter().enumerate() {
        for s in 0..p.n_physical() {
            every.insert(key(k, s));
        }
    }
    assert_eq!(every, distinct, "concat lost or invented a segment");
    let prov = c.layout.provenance().unwrap_or_default().to_vec();
    assert_eq!(prov.len(), c.layout.n_physical());
    let distinct_ids: HashSet<ProvId> = prov.iter().copied().collect();
    assert_eq!(distinct_ids.len(), prov.len());
    for (j, &(k, s)) in c.sources.iter().enumerate() {
        if let Some(p) = inputs[k].provenance() {
            assert_eq!(prov[j], p[s]);
        }
    }
    let got: Vec<Vec<(bool, ProvId)>> = logical(&c.layout)
        .iter()
        .map(|r| r.iter().map(|&i| keys[i]).collect())
        .collect();
    let mut want = Vec::new();
    for (k, p) in inputs.iter().enumerate() {
        for row in logical(p) {
            want.push(row.iter().map(|&s| key(k, s)).collect::<Vec<_>>());
        }
    }
    assert_eq!(got, want);
    let m = match merge(&ci) {
        Ok(m) => m,
        Err(e) => unreachable!("merge failed where concat succeeded: {e}"),
    };
    assert_valid(&m.layout);
    let flat: &[i64] = c.layout.csr().map_or(&[], |x| x.indices());
    let total = flat.len() as i64;
    let merged = m.layout.csr().map(|x| (x.offsets(), x.indices()));
    assert_eq!(merged, Some((&[0, total][..], flat)));
    assert_eq!(m.sources, c.sources);
    // The three NeMo-RL modes on the same inputs (minted ids differ from call to call).
    let outcome = |mode| concat_values(mode, &ci);
    if inputs.is_empty() {
        assert_eq!(outcome(ConcatMode::Concat), Ok(ConcatOutcome::Legacy));
        assert_eq!(
            outcome(ConcatMode::MergeSegments),
            Ok(ConcatOutcome::Legacy)
        );
        assert_eq!(
            outcome(ConcatMode::FlattenedConcat),
            Ok(ConcatOutcome::MaterializeEach)
        );
        return;
    }
    let same = |got: Result<ConcatOutcome, CoreError>, want: &Concat| match got {
        Ok(ConcatOutcome::Interned(got)) => {
            assert_eq!(got.layout.csr(), want.layout.csr());
            assert_eq!(got.sources, want.sources);
        }
        other => unreachable!("inputs with a layout must re-intern, got {other:?}"),
    };
    same(outcome(ConcatMode::Concat), &c);
    same(outcome(ConcatMode::MergeSegments), &m);
    match inputs.iter().position(|p| p.rows() != 1) {
        Some(at) => assert_eq!(
            outcome(ConcatMode::FlattenedConcat),
            Err(CoreError::FlattenedRows {
                at,
                rows: inputs[at].rows()
            })
        ),
        None => same(outcome(ConcatMode::FlattenedConcat), &c),
    }
}

fn check_counts(p: &PackedLayout, b: &mut Bytes<'_>) {
    let rows = logical(p);
    let is_none: Vec<bool> = (0..p.n_physical()).map(|_| b.flag()).collect();
    let counts = p.logical_counts(&is_none);
    let want: Vec<i64> = rows
        .iter()
        .map(|r| r.iter().filter(|&&s| !is_none[s]).count() as i64)
        .collect();
    assert_eq!(counts, Ok(want));
    let nbytes: Vec<u64> = (0..p.n_physical())
        .map(|_| {
            if b.u8() >= 250 {
                u64::MAX / 2
            } else {
                u64::from(b.u8())
            }
        })
        .collect();
    let mut want: Option<u64> = Some(0);
    for r in &rows {
        for &s in r {
            want = want.and_then(|w| w.checked_add(nbytes[s]));
        }
    }
    assert_eq!(p.logical_nbytes(&nbytes).ok(), want);
    // Keys: two segments share one when their byte sizes are equal (so keys repeat).
    let sizes: Vec<Option<Segment>> = (0..p.n_physical())
        .map(|s| {
            (!is_none[s]).then_some(Segment {
                key: nbytes[s] as usize,
                nbytes: nbytes[s],
            })
        })
        .collect();
    let idx: Option<&[i64]> = p.csr().map(|c| c.indices());
    let mut want: Option<(u64, usize)> = Some((0, 0));
    for r in &rows {
        for &s in r {
            if let Some(sz) = sizes[s] {
                want = want.and_then(|(t, n)| t.checked_add(sz.nbytes).map(|t| (t, n + 1)));
            }
        }
    }
    assert_eq!(logical_totals(&sizes, idx).ok(), want);
    // Physical: each distinct key once, even across two measured values.
    let mut seen = SeenSegments::new();
    let distinct: HashSet<usize> = sizes.iter().flatten().map(|s| s.key).collect();
    let physical: Option<u64> = distinct
        .iter()
        .try_fold(0u64, |t, &k| t.checked_add(k as u64));
    match measure(&sizes, idx, &mut seen) {
        Ok(t) => {
            assert_eq!(Some(t.physical_bytes), physical);
            assert_eq!(t.physical_segments, distinct.len());
            assert_eq!(Some((t.logical_bytes, t.logical_segments)), want);
            let again = measure(&sizes, idx, &mut seen).ok();
            assert_eq!(
                again.map(|t| (t.physical_bytes, t.physical_segments)),
                Some((0, 0))
            );
        }
        Err(_) => assert!(physical.is_none() || want.is_none()),
    }
}

/// The CSR fuzz check.
pub fn check(data: &[u8]) {
    let mut b = Bytes::new(data);
    // A mapping the constructors refused cannot exist, so it needs no further check.
    let Some(p) = gen_packed(&mut b) else {
        return;
    };
    let op = b.u8();
    let n = p.rows();
    match op % 5 {
        0 => {
            let rows: Vec<i64> = (0..b.below(10)).map(|_| b.wild(-10, 10)).collect();
            let res = p.slice(&rows);
            let norm: Vec<i64> = rows
                .iter()
                .map(|&r| if r < 0 { r.saturating_add(n as i64) } else { r })
                .collect();
            match norm.iter().find(|&&r| r < 0 || r >= n as i64) {
                Some(&row) => assert_eq!(res, Err(CoreError::RowOutOfRange { row })),
                None => match res {
                    Ok(sel) => {
                        let rows: Vec<usize> = norm.iter().map(|&r| r as usize).collect();
                        check_selection(&p, &sel, &rows);
                    }
                    Err(e) => unreachable!("slice of in-range rows failed: {e}"),
                },
            }
            let (s, e) = (b.below(10), b.below(10));
            match p.slice_range(s, e) {
                Ok(sel) => {
                    assert!(s <= e && e <= n);
                    check_selection(&p, &sel, &(s..e).collect::<Vec<_>>());
                }
                Err(_) => assert!(s > e || e > n),
            }
        }
        1 => {
            let k = b.wild(-2, 9);
            match p.shard(k) {
                Ok(shards) => {
                    assert!(k > 0 && n % (k as usize) == 0);
                    assert_eq!(shards.len(), k as usize);
                    let per = n / k as usize;
                    for (i, sh) in shards.iter().enumerate() {
                        check_selection(&p, sh, &(i * per..(i + 1) * per).collect::<Vec<_>>());
                    }
                }
                Err(CoreError::ShardCount { shards }) => assert!(shards <= 0 && shards == k),
                Err(CoreError::ShardNotDivisible { rows, shards }) => {
                    assert!(rows == n && shards as i64 == k && n % shards != 0);
                }
                // Only a shard count that cannot be held (an empty value) may run out.
                Err(CoreError::ShardsTooMany { shards }) => {
                    assert!(n == 0 && k > 1 << 20 && shards as i64 == k);
                }
                Err(e) => unreachable!("unexpected shard error {e}"),
            }
        }
        2 => check_repeat(&p, b.wild(-2, 4)),
        3 => {
            let mut inputs = vec![p];
            for _ in 0..b.below(4) {
                if let Some(q) = gen_packed(&mut b) {
                    inputs.push(q);
                }
            }
            check_concat(&inputs);
        }
        _ => check_counts(&p, &mut b),
    }
    // Minted ids: distinct, uuid4-shaped, round-trip through bytes.
    if op & 0x80 != 0 {
        let ids = mint(b.below(64)).unwrap_or_default();
        let distinct: HashSet<ProvId> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), ids.len());
        for id in ids {
            let bytes = prov_to_bytes(id);
            assert_eq!(bytes[6] >> 4, 4);
            assert_eq!(bytes[8] >> 6, 2);
            assert_eq!(prov_from_bytes(&bytes), Some(id));
        }
    }
}
