//! Every rule of a batch layout, re-checked on arrays built elsewhere (a batch built by hand,
//! or packs joined into a micro-batch): the fields agree with each other exactly as the
//! builders make them (see the `batch` module docs), or the first disagreement is reported,
//! naming the field, the sample and the position.
//!
//! Masks arrive as bytes (0 or 1): a bool array from numpy or torch can hold other bytes.
use std::fmt;

use crate::error::{CoreError, CoreResult};

/// One THD pack or micro-batch, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct ThdView<'a> {
    pub input_ids: &'a [i64],
    pub labels: &'a [i64],
    pub loss_mask: &'a [u8],
    pub token_mask: &'a [u8],
    pub position_ids: &'a [i64],
    pub cu_seqlens: &'a [i32],
    pub cu_seqlens_padded: &'a [i32],
    pub max_seqlen: usize,
}

/// Padded rows, row-major `[rows, width]`, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct PaddedView<'a> {
    pub rows: usize,
    pub width: usize,
    pub input_ids: &'a [i64],
    pub labels: &'a [i64],
    pub loss_mask: &'a [u8],
    pub token_mask: &'a [u8],
    pub position_ids: &'a [i64],
    pub attention_mask: &'a [u8],
    pub lengths: &'a [i64],
}

fn bad(detail: String) -> CoreError {
    CoreError::BatchLayout { detail }
}

/// The positions of one sample: `width` slots starting at `start` of the flat arrays, the
/// first `len` of them its tokens.
struct Segment<'a> {
    input_ids: &'a [i64],
    labels: &'a [i64],
    loss_mask: &'a [u8],
    token_mask: &'a [u8],
    position_ids: &'a [i64],
}

/// The slots `[start, start + width)` of every per-position array (the caller checked that
/// each array is long enough).
fn segment<'a>(
    input_ids: &'a [i64],
    labels: &'a [i64],
    loss_mask: &'a [u8],
    token_mask: &'a [u8],
    position_ids: &'a [i64],
    start: usize,
    width: usize,
) -> Option<Segment<'a>> {
    let r = start..start.checked_add(width)?;
    Some(Segment {
        input_ids: input_ids.get(r.clone())?,
        labels: labels.get(r.clone())?,
        loss_mask: loss_mask.get(r.clone())?,
        token_mask: token_mask.get(r.clone())?,
        position_ids: position_ids.get(r)?,
    })
}

/// Position `p` of a sample as the arrays index it, formatted only when an error names it.
struct Pos<'a> {
    index: &'a dyn Fn(usize) -> String,
    p: usize,
}

impl fmt::Display for Pos<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&(self.index)(self.p))
    }
}

/// Check one sample's slots; `at` names the sample and `index(p)` position `p` of it in the
/// arrays (`[flat]` or `[row, p]`). Returns its largest token id.
fn check_segment(
    seg: &Segment<'_>,
    len: usize,
    pad_token_id: i64,
    ignore_index: i64,
    at: &str,
    index: &dyn Fn(usize) -> String,
) -> CoreResult<i64> {
    let mut top = -1i64;
    let fields = seg
        .input_ids
        .iter()
        .zip(seg.labels)
        .zip(seg.loss_mask)
        .zip(seg.token_mask)
        .zip(seg.position_ids)
        .enumerate();
    for (p, ((((&id, &label), &lm), &tm), &pos)) in fields {
        let flat = Pos { index, p };
        if i64::try_from(p).ok() != Some(pos) {
            return Err(bad(format!(
                "position_ids{flat} ({at}, position {p}) is {pos}, expected {p}: positions \
                 restart at 0 per sample and count on through its padding"
            )));
        }
        if lm > 1 || tm > 1 {
            let (name, v) = if lm > 1 {
                ("loss_mask", lm)
            } else {
                ("token_mask", tm)
            };
            return Err(bad(format!(
                "{name}{flat} ({at}) holds the byte {v}, not 0 or 1"
            )));
        }
        if p < len {
            if id < 0 {
                return Err(bad(format!(
                    "input_ids{flat} ({at}, position {p}) is the negative id {id}"
                )));
            }
            top = top.max(id);
        } else {
            if id != pad_token_id {
                return Err(bad(format!(
                    "input_ids{flat} ({at}, padding) is {id}, not pad_token_id={pad_token_id}"
                )));
            }
            if tm != 0 {
                return Err(bad(format!("token_mask{flat} ({at}) is 1 on padding")));
            }
        }
        // The label predicts the next token of the same sample where that token is trainable.
        let next = (p + 1 < len)
            .then(|| {
                seg.input_ids
                    .get(p + 1)
                    .zip(seg.token_mask.get(p + 1))
                    .filter(|&(_, &m)| m != 0)
                    .map(|(&t, _)| t)
            })
            .flatten();
        let want = next.unwrap_or(ignore_index);
        if label != want {
            let why = match next {
                Some(_) => format!("input_ids{}, trainable", index(p + 1)),
                None if p + 1 < len => format!("token_mask{} is 0", index(p + 1)),
                None => "nothing follows in the sample".to_owned(),
            };
            return Err(bad(format!(
                "labels{flat} ({at}, position {p}) is {label}, expected {want} ({why}); \
                 labels are the next token where it is trainable, else ignore_index"
            )));
        }
        if (lm != 0) != (label != ignore_index) {
            return Err(bad(format!(
                "loss_mask{flat} ({at}, position {p}) is {lm} but labels{flat} is {label}: \
                 loss_mask is labels != ignore_index={ignore_index}"
            )));
        }
    }
    Ok(top)
}

fn check_ignore_index(ignore_index: i64, top: (i64, usize)) -> CoreResult<()> {
    if (0..=top.0).contains(&ignore_index) {
        return Err(bad(format!(
            "ignore_index={ignore_index} is a token id of the batch (ids go up to {}, in \
             sample {}); use a negative value such as -100",
            top.0, top.1
        )));
    }
    Ok(())
}

fn check_pad_token(pad_token_id: i64) -> CoreResult<()> {
    if pad_token_id < 0 {
        return Err(bad(format!(
            "pad_token_id={pad_token_id} is negative; the padding is a token id fed to the model"
        )));
    }
    Ok(())
}

fn expect_len(name: &str, actual: usize, expected: usize, of: &str) -> CoreResult<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(bad(format!(
            "{name} has {actual} entries, expected {expected} ({of})"
        )))
    }
}

/// Check a THD pack or micro-batch.
///
/// # Errors
/// `BatchLayout` naming the first disagreement.
pub fn check_thd(v: &ThdView<'_>, pad_token_id: i64, ignore_index: i64) -> CoreResult<()> {
    check_pad_token(pad_token_id)?;
    let (cu, cup) = (v.cu_seqlens, v.cu_seqlens_padded);
    if cu.len() < 2 {
        return Err(bad(format!(
            "cu_seqlens has {} entries; a batch holds at least one sample ([0, len_0, ...])",
            cu.len()
        )));
    }
    expect_len(
        "cu_seqlens_padded",
        cup.len(),
        cu.len(),
        "one per entry of cu_seqlens",
    )?;
    if cu.first() != Some(&0) || cup.first() != Some(&0) {
        return Err(bad("cu_seqlens and cu_seqlens_padded start at 0".to_owned()));
    }
    let total = cup.last().map_or(0, |&t| usize::try_from(t).unwrap_or(0));
    let of = "cu_seqlens_padded[-1] positions";
    expect_len("input_ids", v.input_ids.len(), total, of)?;
    expect_len("labels", v.labels.len(), total, of)?;
    expect_len("loss_mask", v.loss_mask.len(), total, of)?;
    expect_len("token_mask", v.token_mask.len(), total, of)?;
    expect_len("position_ids", v.position_ids.len(), total, of)?;
    let mut max_width = 0;
    let mut top = (-1i64, 0usize);
    for (i, (c, p)) in cu.windows(2).zip(cup.windows(2)).enumerate() {
        let (&[c0, c1], &[p0, p1]) = (c, p) else {
            continue;
        };
        let len = usize::try_from(i64::from(c1) - i64::from(c0)).ok();
        let width = usize::try_from(i64::from(p1) - i64::from(p0)).ok();
        let (Some(len), Some(width)) = (len, width) else {
            return Err(bad(format!(
                "cu_seqlens / cu_seqlens_padded decrease at sample {i}"
            )));
        };
        if len == 0 || len > width {
            return Err(bad(format!(
                "sample {i} has {len} tokens in {width} padded positions (cu_seqlens vs \
                 cu_seqlens_padded); every sample has 1..=padded tokens"
            )));
        }
        max_width = max_width.max(width);
        let start = usize::try_from(p0).unwrap_or(0);
        let seg = segment(
            v.input_ids,
            v.labels,
            v.loss_mask,
            v.token_mask,
            v.position_ids,
            start,
            width,
        )
        .ok_or_else(|| bad(format!("sample {i} ends past the arrays")))?;
        let t = check_segment(
            &seg,
            len,
            pad_token_id,
            ignore_index,
            &format!("sample {i}"),
            &|p| format!("[{}]", start + p),
        )?;
        if t > top.0 {
            top = (t, i);
        }
    }
    if v.max_seqlen != max_width {
        return Err(bad(format!(
            "max_seqlen is {}, but the longest padded sample has {max_width} positions",
            v.max_seqlen
        )));
    }
    check_ignore_index(ignore_index, top)
}

/// Check padded rows.
///
/// # Errors
/// `BatchLayout` naming the first disagreement.
pub fn check_padded(v: &PaddedView<'_>, pad_token_id: i64, ignore_index: i64) -> CoreResult<()> {
    check_pad_token(pad_token_id)?;
    if v.rows == 0 || v.width == 0 {
        return Err(bad(format!(
            "the rows are [{}, {}]; a batch holds at least one sample and one position",
            v.rows, v.width
        )));
    }
    let cells = v
        .rows
        .checked_mul(v.width)
        .ok_or(CoreError::IndexOverflow {
            what: "rows * width",
        })?;
    let of = "rows * width";
    expect_len("input_ids", v.input_ids.len(), cells, of)?;
    expect_len("labels", v.labels.len(), cells, of)?;
    expect_len("loss_mask", v.loss_mask.len(), cells, of)?;
    expect_len("token_mask", v.token_mask.len(), cells, of)?;
    expect_len("position_ids", v.position_ids.len(), cells, of)?;
    expect_len("attention_mask", v.attention_mask.len(), cells, of)?;
    expect_len("lengths", v.lengths.len(), v.rows, "one per row")?;
    let mut top = (-1i64, 0usize);
    for (r, &len) in v.lengths.iter().enumerate() {
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| (1..=v.width).contains(&n))
            .ok_or_else(|| {
                bad(format!(
                    "lengths[{r}] is {len}; a row holds 1..={} tokens",
                    v.width
                ))
            })?;
        let start = r * v.width;
        let row = start..start + v.width;
        let attention = v.attention_mask.get(row).unwrap_or_default();
        if let Some(p) = attention
            .iter()
            .enumerate()
            .position(|(p, &a)| a != u8::from(p < len))
        {
            return Err(bad(format!(
                "attention_mask[{r}, {p}] is {}, expected {}: the attention mask is \
                 position < lengths[{r}]={len}",
                attention.get(p).copied().unwrap_or(0),
                u8::from(p < len)
            )));
        }
        let seg = segment(
            v.input_ids,
            v.labels,
            v.loss_mask,
            v.token_mask,
            v.position_ids,
            start,
            v.width,
        )
        .ok_or_else(|| bad(format!("row {r} ends past the arrays")))?;
        let t = check_segment(
            &seg,
            len,
            pad_token_id,
            ignore_index,
            &format!("row {r}"),
            &|p| format!("[{r}, {p}]"),
        )?;
        if t > top.0 {
            top = (t, r);
        }
    }
    check_ignore_index(ignore_index, top)
}
