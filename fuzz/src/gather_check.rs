//! Byte gathers against a plain concatenation model.
use mmpack_core::gather::{gather_into, gather_ranges_into, gathered_len};

use crate::bytes::Bytes;

fn check_gather(b: &mut Bytes<'_>) {
    let n_src = b.below(6);
    let big = b.u8() == 255;
    let sources: Vec<Vec<u8>> = (0..n_src)
        .map(|k| {
            let len = if big {
                70_000 + b.below(4) * 3
            } else {
                b.below(24)
            };
            (0..len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(k as u8))
                .collect()
        })
        .collect();
    let order: Vec<i64> = (0..b.below(if big { 20 } else { 10 }))
        .map(|_| b.wild(-1, n_src as i64))
        .collect();
    let outer = b.below(5);
    let lens: Vec<usize> = sources.iter().map(Vec::len).collect();
    // Model.
    let mut want: Option<Vec<u8>> = Some(Vec::new());
    for &k in &order {
        let ok = usize::try_from(k)
            .ok()
            .and_then(|k| sources.get(k))
            .is_some_and(|s| {
                if outer == 0 {
                    s.is_empty()
                } else {
                    s.len() % outer == 0
                }
            });
        if !ok {
            want = None;
        }
    }
    if let Some(w) = want.as_mut() {
        for o in 0..outer.max(1) {
            for &k in &order {
                let s = &sources[k as usize];
                let blk = s.len() / outer.max(1);
                w.extend_from_slice(&s[o * blk..(o + 1) * blk]);
            }
        }
    }
    let total = gathered_len(&lens, &order, outer);
    assert_eq!(total.as_ref().ok().copied(), want.as_ref().map(Vec::len));
    let srcs: Vec<&[u8]> = sources.iter().map(Vec::as_slice).collect();
    let out_len = match (&want, b.u8()) {
        (Some(w), 0..=239) => w.len(),
        (_, t) => usize::from(t) % 7,
    };
    let mut out = vec![0xAAu8; out_len];
    let res = gather_into(&mut out, &srcs, &order, outer);
    match want {
        Some(w) if w.len() == out_len => {
            assert!(res.is_ok(), "{res:?}");
            assert_eq!(out, w);
        }
        _ => assert!(res.is_err()),
    }
}

fn check_ranges(b: &mut Bytes<'_>) {
    let src_len = b.below(64);
    let src: Vec<u8> = (0..src_len).map(|i| (i as u8).wrapping_mul(7)).collect();
    let n_seg = b.below(6);
    let starts: Vec<i64> = (0..n_seg).map(|_| b.wild(-1, 40)).collect();
    let n_lens = if b.u8() < 240 { n_seg } else { b.below(7) };
    let lens: Vec<i64> = (0..n_lens).map(|_| b.wild(-1, 12)).collect();
    let order: Vec<i64> = (0..b.below(8)).map(|_| b.wild(-1, n_seg as i64)).collect();
    let outer = b.below(4);
    let stride = if b.u8() == 255 {
        usize::MAX / 2
    } else {
        b.below(20)
    };
    // Model: every segment must fit in the last outer block, every order entry must exist.
    let last = (outer.saturating_sub(1) as u128) * stride as u128;
    let mut want: Option<Vec<u8>> = (starts.len() == lens.len()).then(Vec::new);
    for (&s, &l) in starts.iter().zip(&lens) {
        if s < 0 || l < 0 || (s as u128) + (l as u128) + last > src_len as u128 {
            want = None;
        }
    }
    if order.iter().any(|&k| k < 0 || k as usize >= starts.len()) {
        want = None;
    }
    if let Some(w) = want.as_mut() {
        for o in 0..outer {
            for &k in &order {
                let s = o * stride + starts[k as usize] as usize;
                w.extend_from_slice(&src[s..s + lens[k as usize] as usize]);
            }
        }
    }
    let out_len = match (&want, b.u8()) {
        (Some(w), 0..=239) => w.len(),
        (_, t) => usize::from(t) % 7,
    };
    let mut out = vec![0x55u8; out_len];
    let res = gather_ranges_into(&mut out, &src, &starts, &lens, &order, outer, stride);
    match want {
        Some(w) if w.len() == out_len => {
            assert!(res.is_ok(), "{res:?}");
            assert_eq!(out, w);
        }
        _ => assert!(res.is_err(), "accepted a bad gather"),
    }
}

/// The gather fuzz check.
pub fn check(data: &[u8]) {
    let mut b = Bytes::new(data);
    if b.flag() {
        check_gather(&mut b);
    } else {
        check_ranges(&mut b);
    }
}
