//! Batch layouts for trainers: one THD pack (Megatron's packed format), several packs as one
//! THD micro-batch, and padded `[rows, width]` rows. Every field is computed here, once, with
//! one alignment per field:
//!
//! - `labels[p]`: shifted. `input_ids[p + 1]` when `p + 1` is inside the same sample and that
//!   token is trainable, else `ignore_index` (every sample's last token and all padding).
//! - `loss_mask[p]`: aligned with `labels` (Megatron's GPT loss): `labels[p] != ignore_index`.
//! - `token_mask[p]`: aligned with `input_ids` (NeMo-RL): the token at `p` is trainable.
//! - `position_ids`: restart at 0 per sample and count on through its padding.
//! - padded rows: `attention_mask[r, p] = p < lengths[r]`, from the lengths, never from tokens.
//!
//! THD layout: sample `i` occupies `[cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i)`,
//! followed by `padded_len_i - len_i` padding positions; `padded_len_i` rounds `len_i` up to
//! the padding multiple (`pad_to_multiple_of`, and with `cp_size > 1` the least common multiple
//! of that and `2 * cp_size`). With `pad_to_length` the last sample also absorbs the padding up
//! to that total (Megatron's pipeline parallelism needs one shape per micro-batch).
//!
//! `ignore_index` must not be a token id of the batch (else a label equal to it would silently
//! leave the loss), and `pad_token_id` must be a token id (non-negative). [`check`] re-checks
//! every rule on layouts built elsewhere.
use crate::alloc;
use crate::error::{CoreError, CoreResult};
use crate::mask::{self, MaskView};

pub mod check;

pub use check::{check_padded, check_thd, PaddedView, ThdView};

/// Who provides the loss mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskMode {
    /// Derived from message lengths and roles.
    Derived,
    /// The sample's own mask, validated.
    Precomputed,
}

/// One encoded sample, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct SampleRef<'a> {
    /// How errors name the sample.
    pub name: &'a str,
    pub tokens: &'a [i64],
    /// One 0/1 value per token (aligned with `tokens`), read in precomputed mode.
    pub mask: Option<MaskView<'a>>,
    pub message_lengths: Option<&'a [i64]>,
    pub message_roles: Option<&'a [String]>,
}

/// How a batch is built: the mask mode, the trained roles, the padding and the label fill.
/// One value serves every builder (`build`, `build_padded`, `concat`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchOptions {
    pub mode: MaskMode,
    /// Roles whose messages are trained on (read in derived mode).
    pub train_roles: Vec<String>,
    pub pad_token_id: i64,
    pub pad_to_multiple_of: i64,
    pub ignore_index: i64,
    pub cp_size: i64,
    /// THD: the total length of the pack; padded: the width of every row. `None`: as short as
    /// the samples and the padding multiple allow.
    pub pad_to_length: Option<i64>,
}

impl Default for BatchOptions {
    fn default() -> Self {
        Self {
            mode: MaskMode::Derived,
            train_roles: vec!["assistant".to_owned()],
            pad_token_id: 0,
            pad_to_multiple_of: 1,
            ignore_index: -100,
            cp_size: 1,
            pad_to_length: None,
        }
    }
}

impl BatchOptions {
    /// Check the options on their own, before any sample is seen: the checks every builder
    /// makes first, so a bad value is reported where the options are made.
    ///
    /// # Errors
    /// `BatchOption` naming the option (a negative `pad_token_id`, `pad_to_multiple_of` or
    /// `cp_size` below 1, a `pad_to_length` below 1 or not a multiple of the padding
    /// multiple); `IndexOverflow` for a padding multiple past `usize`.
    pub fn validate(&self) -> CoreResult<()> {
        check_options(self).map(|_| ())
    }
}

/// The flat arrays of one pack (or micro-batch) in Megatron's THD layout (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThdLayout {
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub loss_mask: Vec<bool>,
    pub token_mask: Vec<bool>,
    pub position_ids: Vec<i64>,
    pub cu_seqlens: Vec<i32>,
    pub cu_seqlens_padded: Vec<i32>,
    pub max_seqlen: usize,
}

/// Padded rows, row-major `[rows, width]` (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaddedLayout {
    pub rows: usize,
    pub width: usize,
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub loss_mask: Vec<bool>,
    pub token_mask: Vec<bool>,
    pub position_ids: Vec<i64>,
    pub attention_mask: Vec<bool>,
    /// Tokens per row (the rest of the row is padding).
    pub lengths: Vec<i64>,
}

fn option_error(name: &'static str, detail: String) -> CoreError {
    CoreError::BatchOption { name, detail }
}

fn gcd(a: usize, b: usize) -> usize {
    let (mut a, mut b) = (a, b);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The multiple every sample is padded to.
///
/// # Errors
/// `BatchOption` for `pad_to_multiple_of < 1` or `cp_size < 1`, or a multiple past `usize`
/// (naming the option that makes it so).
pub fn pad_multiple(pad_to_multiple_of: i64, cp_size: i64) -> CoreResult<usize> {
    let pad = usize::try_from(pad_to_multiple_of)
        .ok()
        .filter(|&p| p >= 1)
        .ok_or_else(|| {
            option_error(
                "pad_to_multiple_of",
                format!("must be >= 1, got {pad_to_multiple_of}"),
            )
        })?;
    let cp = usize::try_from(cp_size)
        .ok()
        .filter(|&c| c >= 1)
        .ok_or_else(|| option_error("cp_size", format!("must be >= 1, got {cp_size}")))?;
    if cp == 1 {
        return Ok(pad);
    }
    let too_large = || {
        option_error(
            multiple_option(pad_to_multiple_of, cp_size),
            format!(
                "the padding multiple of pad_to_multiple_of={pad_to_multiple_of} and \
                 cp_size={cp_size} (their least common multiple with 2 * cp_size) overflows"
            ),
        )
    };
    let two_cp = cp.checked_mul(2).ok_or_else(too_large)?;
    (pad / gcd(pad, two_cp))
        .checked_mul(two_cp)
        .ok_or_else(too_large)
}

/// The option blamed for a padding multiple that is too large: the larger of
/// `pad_to_multiple_of` and `2 * cp_size`.
fn multiple_option(pad_to_multiple_of: i64, cp_size: i64) -> &'static str {
    if cp_size > 1 && pad_to_multiple_of / 2 < cp_size {
        "cp_size"
    } else {
        "pad_to_multiple_of"
    }
}

/// The options every builder checks first: the padding multiple and `pad_to_length`.
struct Layout {
    multiple: usize,
    pad_to_length: Option<usize>,
    /// The option a padding multiple too large for the batch is blamed on.
    multiple_name: &'static str,
}

impl Layout {
    /// `n` rounded up to the padding multiple.
    fn round_up(&self, n: usize, opts: &BatchOptions) -> CoreResult<usize> {
        let rem = n % self.multiple;
        if rem == 0 {
            return Ok(n);
        }
        n.checked_add(self.multiple - rem).ok_or_else(|| {
            option_error(
                self.multiple_name,
                format!(
                    "padding {n} tokens to a multiple of {} (pad_to_multiple_of={}, \
                     cp_size={}) overflows",
                    self.multiple, opts.pad_to_multiple_of, opts.cp_size
                ),
            )
        })
    }

    /// A THD batch's `pad_to_length` fits its int32 offsets.
    fn check_thd_target(&self) -> CoreResult<()> {
        match self.pad_to_length {
            Some(l) if l > THD_MAX => Err(option_error(
                "pad_to_length",
                format!(
                    "{l} positions do not fit a THD batch, whose offsets (cu_seqlens) are int32: \
                     at most {THD_MAX}"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The error for a batch of `cells` positions (`bytes` in all) that cannot be allocated:
    /// blamed on `pad_to_length` or the padding multiple when they made it that large
    /// (`padded`), else on the samples.
    fn alloc_error(&self, cells: usize, bytes: Option<usize>, padded: bool) -> CoreError {
        let size = bytes.map_or_else(|| "more than usize".to_owned(), |b| format!("{b} bytes"));
        let detail =
            format!("the batch needs {cells} positions ({size}), which cannot be allocated");
        match (self.pad_to_length, padded) {
            (Some(_), true) => option_error("pad_to_length", detail),
            (None, true) => option_error(self.multiple_name, detail),
            (_, false) => CoreError::IndexOverflow {
                what: "the batch's size (its positions cannot be allocated)",
            },
        }
    }
}

/// The most positions of a THD batch: its offsets are int32.
const THD_MAX: usize = i32::MAX as usize;

/// Bytes per position of the five per-position fields (`input_ids`, `labels`, `position_ids`
/// as i64, the two masks as bool).
const BYTES_PER_POSITION: usize = 3 * size_of::<i64>() + 2 * size_of::<bool>();

fn check_options(opts: &BatchOptions) -> CoreResult<Layout> {
    if opts.pad_token_id < 0 {
        return Err(option_error(
            "pad_token_id",
            format!(
                "must be a token id (>= 0), got {}; the padding is fed to the model",
                opts.pad_token_id
            ),
        ));
    }
    let multiple = pad_multiple(opts.pad_to_multiple_of, opts.cp_size)?;
    let pad_to_length = opts
        .pad_to_length
        .map(|l| target_length(l, multiple, opts))
        .transpose()?;
    Ok(Layout {
        multiple,
        pad_to_length,
        multiple_name: multiple_option(opts.pad_to_multiple_of, opts.cp_size),
    })
}

/// `pad_to_length` as a length: positive and a multiple of the padding multiple (the last
/// sample absorbs the difference, and its padded length must stay such a multiple).
fn target_length(length: i64, multiple: usize, opts: &BatchOptions) -> CoreResult<usize> {
    let l = usize::try_from(length)
        .ok()
        .filter(|&l| l >= 1)
        .ok_or_else(|| option_error("pad_to_length", format!("must be >= 1, got {length}")))?;
    if l % multiple != 0 {
        return Err(option_error(
            "pad_to_length",
            format!(
                "{l} is not a multiple of {multiple}, the padding multiple of \
                 pad_to_multiple_of={} and cp_size={}",
                opts.pad_to_multiple_of, opts.cp_size
            ),
        ));
    }
    Ok(l)
}

fn as_i32(v: usize) -> CoreResult<i32> {
    i32::try_from(v).map_err(|_| CoreError::IndexOverflow {
        what: "cu_seqlens (int32)",
    })
}

fn as_i64(v: usize, what: &'static str) -> CoreResult<i64> {
    i64::try_from(v).map_err(|_| CoreError::IndexOverflow { what })
}

/// The trainable flags of sample `s` (one per token) into `out`, after the token checks (not
/// empty, no negative id). Returns the sample's largest token id.
fn sample_mask(
    s: &SampleRef<'_>,
    opts: &BatchOptions,
    trainable: &mut Vec<bool>,
    out: &mut Vec<bool>,
) -> CoreResult<i64> {
    let n = s.tokens.len();
    if n == 0 {
        return Err(CoreError::EmptySample {
            sample: s.name.to_owned(),
        });
    }
    if let Some(pos) = s.tokens.iter().position(|&t| t < 0) {
        let value = s.tokens.get(pos).copied().unwrap_or(-1);
        return Err(CoreError::InvalidToken {
            sample: s.name.to_owned(),
            position: pos,
            value,
        });
    }
    out.clear();
    match opts.mode {
        MaskMode::Precomputed => {
            let m = s.mask.ok_or_else(|| CoreError::MissingField {
                sample: s.name.to_owned(),
                field: "loss_mask",
                mode: "'precomputed'",
            })?;
            mask::extend_validated(m, n, s.name, out)?;
        }
        MaskMode::Derived => {
            let missing = |field| CoreError::MissingField {
                sample: s.name.to_owned(),
                field,
                mode: "None (derived from roles)",
            };
            let lengths = s
                .message_lengths
                .ok_or_else(|| missing("message_lengths"))?;
            let roles = s.message_roles.ok_or_else(|| missing("message_roles"))?;
            trainable.clear();
            trainable.extend(
                roles
                    .iter()
                    .map(|r| opts.train_roles.iter().any(|t| t == r)),
            );
            mask::extend_from_spans(lengths, trainable, Some(n), s.name, "message", out)?;
        }
    }
    Ok(s.tokens.iter().copied().max().unwrap_or(0))
}

/// `ignore_index` must not be a token id of the batch: a label equal to it would leave the
/// loss unnoticed. `max_token` is the batch's largest id, first found in sample `owner`.
pub(crate) fn ignore_index_error(ignore_index: i64, max_token: i64, owner: &str) -> CoreError {
    option_error(
        "ignore_index",
        format!(
            "{ignore_index} is a valid token id of this batch (its ids go up to {max_token}, \
             in sample {owner}), so labels of that token would be ignored; use a negative \
             value such as -100"
        ),
    )
}

/// The per-position arrays both layouts share, appended sample by sample.
#[derive(Default)]
struct Fields {
    input_ids: Vec<i64>,
    labels: Vec<i64>,
    loss_mask: Vec<bool>,
    token_mask: Vec<bool>,
    position_ids: Vec<i64>,
}

impl Fields {
    /// Room for `n` positions in every field, or `err()` (nothing is written before the
    /// whole batch has room).
    fn with_capacity(n: usize, err: impl Fn() -> CoreError) -> CoreResult<Self> {
        Ok(Self {
            input_ids: alloc::vec_with_capacity(n, &err)?,
            labels: alloc::vec_with_capacity(n, &err)?,
            loss_mask: alloc::vec_with_capacity(n, &err)?,
            token_mask: alloc::vec_with_capacity(n, &err)?,
            position_ids: alloc::vec_with_capacity(n, &err)?,
        })
    }

    /// One sample over `width >= tokens.len()` positions: its tokens, then padding.
    fn push_sample(
        &mut self,
        tokens: &[i64],
        trainable: &[bool],
        width: usize,
        pad_token_id: i64,
        ignore_index: i64,
    ) -> CoreResult<()> {
        let pad = width.saturating_sub(tokens.len());
        self.input_ids.extend_from_slice(tokens);
        self.input_ids
            .extend(std::iter::repeat_n(pad_token_id, pad));
        // labels[p] = tokens[p + 1] where that token is trainable; loss_mask = labels trained.
        let next = tokens.iter().zip(trainable).skip(1);
        self.labels
            .extend(next.map(|(&t, &m)| if m { t } else { ignore_index }));
        self.loss_mask
            .extend(trainable.get(1..).unwrap_or_default());
        // The last token predicts nothing in its sample; padding predicts nothing.
        self.labels
            .extend(std::iter::repeat_n(ignore_index, pad + 1));
        self.loss_mask.extend(std::iter::repeat_n(false, pad + 1));
        self.token_mask.extend_from_slice(trainable);
        self.token_mask.extend(std::iter::repeat_n(false, pad));
        self.position_ids
            .extend(0..as_i64(width, "position ids (int64)")?);
        Ok(())
    }

    /// `extra` more padding positions for the sample that ends the arrays (its positions so
    /// far: `0..width`).
    fn extend_last(
        &mut self,
        width: usize,
        extra: usize,
        pad_token_id: i64,
        ignore_index: i64,
    ) -> CoreResult<()> {
        self.input_ids
            .extend(std::iter::repeat_n(pad_token_id, extra));
        self.labels.extend(std::iter::repeat_n(ignore_index, extra));
        self.loss_mask.extend(std::iter::repeat_n(false, extra));
        self.token_mask.extend(std::iter::repeat_n(false, extra));
        let end = width.checked_add(extra).ok_or(CoreError::IndexOverflow {
            what: "position ids",
        })?;
        self.position_ids
            .extend(as_i64(width, "position ids (int64)")?..as_i64(end, "position ids (int64)")?);
        Ok(())
    }
}

/// The padded width of every sample of a pack, the last one absorbing `pad_to_length`.
///
/// # Errors
/// `BatchOption` naming the padding option when padding takes the pack past int32 offsets,
/// or `pad_to_length` when the pack is longer; `IndexOverflow` when the tokens alone do.
fn pack_widths(
    samples: &[SampleRef<'_>],
    layout: &Layout,
    opts: &BatchOptions,
) -> CoreResult<Vec<usize>> {
    let mut widths = Vec::with_capacity(samples.len());
    let mut total: usize = 0;
    let mut tokens: usize = 0;
    for s in samples {
        let w = layout.round_up(s.tokens.len(), opts)?;
        // Never past usize: each sample is held in memory, and w < 2 * max(len, multiple).
        tokens = tokens.saturating_add(s.tokens.len());
        total = total.saturating_add(w);
        widths.push(w);
    }
    if total > THD_MAX {
        if tokens > THD_MAX {
            return Err(CoreError::IndexOverflow {
                what: "cu_seqlens (int32)",
            });
        }
        return Err(option_error(
            layout.multiple_name,
            format!(
                "padding each of {} samples to a multiple of {} makes the pack {total} \
                 positions, more than the {THD_MAX} its int32 offsets (cu_seqlens) hold",
                samples.len(),
                layout.multiple
            ),
        ));
    }
    if let Some(target) = layout.pad_to_length {
        if total > target {
            return Err(option_error(
                "pad_to_length",
                format!(
                    "the pack needs {total} positions ({} samples, each padded to a multiple \
                     of {}), more than pad_to_length={target}",
                    samples.len(),
                    layout.multiple
                ),
            ));
        }
        if let Some(last) = widths.last_mut() {
            *last += target - total;
        }
    }
    Ok(widths)
}

/// `[0, cumsum(values)]` as int32 offsets.
fn offsets(values: impl Iterator<Item = usize>) -> CoreResult<Vec<i32>> {
    let mut out = vec![0i32];
    let mut total: usize = 0;
    for v in values {
        total = total.checked_add(v).ok_or(CoreError::IndexOverflow {
            what: "pack length",
        })?;
        out.push(as_i32(total)?);
    }
    Ok(out)
}

/// Build one pack from `samples` (see the module docs for the layout and the fields).
///
/// # Errors
/// `EmptyBatch`, `EmptySample`, `InvalidToken`, `MissingField`, mask errors (`MaskLength`,
/// `MaskValue`, `SpanMismatch`), `BatchOption` (options out of range, a pack longer than
/// `pad_to_length`, an `ignore_index` that is a token id), `IndexOverflow` (a pack past
/// `i32::MAX` positions).
pub fn build(samples: &[SampleRef<'_>], opts: &BatchOptions) -> CoreResult<ThdLayout> {
    if samples.is_empty() {
        return Err(CoreError::EmptyBatch);
    }
    let layout = check_options(opts)?;
    layout.check_thd_target()?;

    // Pass 1: layout (offsets and sizes), so nothing is allocated for a pack that cannot exist.
    let widths = pack_widths(samples, &layout, opts)?;
    let cu_seqlens = offsets(samples.iter().map(|s| s.tokens.len()))?;
    let cu_seqlens_padded = offsets(widths.iter().copied())?;
    let total: usize = widths.iter().sum();
    let max_seqlen = widths.iter().copied().max().unwrap_or(0);
    let tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
    let longest = samples.iter().map(|s| s.tokens.len()).max().unwrap_or(0);

    // The whole pack at once, before any of it is written.
    let bytes = alloc::bytes_of::<u8>(total).and_then(|b| b.checked_mul(BYTES_PER_POSITION));
    let refused = || layout.alloc_error(total, bytes, total > tokens);
    alloc::probe(bytes, refused)?;

    // Pass 2, sample by sample: checks (tokens, then mask), then the arrays.
    let mut trainable_msgs = Vec::new();
    let mut trainable = Vec::with_capacity(longest);
    let mut fields = Fields::with_capacity(total, refused)?;
    let mut max_token = (-1i64, "");
    for (s, &width) in samples.iter().zip(&widths) {
        let top = sample_mask(s, opts, &mut trainable_msgs, &mut trainable)?;
        if top > max_token.0 {
            max_token = (top, s.name);
        }
        fields.push_sample(
            s.tokens,
            &trainable,
            width,
            opts.pad_token_id,
            opts.ignore_index,
        )?;
    }
    if (0..=max_token.0).contains(&opts.ignore_index) {
        return Err(ignore_index_error(
            opts.ignore_index,
            max_token.0,
            max_token.1,
        ));
    }
    Ok(ThdLayout {
        input_ids: fields.input_ids,
        labels: fields.labels,
        loss_mask: fields.loss_mask,
        token_mask: fields.token_mask,
        position_ids: fields.position_ids,
        cu_seqlens,
        cu_seqlens_padded,
        max_seqlen,
    })
}

/// Build padded rows from `samples`, one row per sample: the width is the longest sample
/// rounded up to the padding multiple, or `pad_to_length`.
///
/// # Errors
/// As [`build`]; `BatchOption` when the longest sample does not fit `pad_to_length`;
/// `IndexOverflow` when `rows * width` does not fit in memory's index range.
pub fn build_padded(samples: &[SampleRef<'_>], opts: &BatchOptions) -> CoreResult<PaddedLayout> {
    if samples.is_empty() {
        return Err(CoreError::EmptyBatch);
    }
    let layout = check_options(opts)?;
    let longest = samples.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    let mut width = layout.round_up(longest, opts)?;
    if let Some(target) = layout.pad_to_length {
        if width > target {
            return Err(option_error(
                "pad_to_length",
                format!(
                    "the longest sample has {longest} tokens ({width} padded to a multiple of \
                     {}), more than pad_to_length={target}",
                    layout.multiple
                ),
            ));
        }
        width = target;
    }
    let rows = samples.len();
    // The whole batch at once (the per-position fields, the attention mask, the lengths),
    // before any of it is written.
    let cells = rows.checked_mul(width);
    let bytes = cells.and_then(|c| {
        alloc::total_bytes(&[
            (c, BYTES_PER_POSITION + size_of::<bool>()),
            (rows, size_of::<i64>()),
        ])
    });
    let cells_shown = cells.unwrap_or(usize::MAX);
    let refused = || layout.alloc_error(cells_shown, bytes, width > longest);
    alloc::probe(bytes.filter(|&b| isize::try_from(b).is_ok()), refused)?;
    let cells = cells.ok_or_else(refused)?;
    let mut trainable_msgs = Vec::new();
    let mut trainable = Vec::with_capacity(longest);
    let mut fields = Fields::with_capacity(cells, refused)?;
    let mut attention_mask = alloc::vec_with_capacity(cells, refused)?;
    let mut lengths = Vec::with_capacity(rows);
    let mut max_token = (-1i64, "");
    for s in samples {
        let top = sample_mask(s, opts, &mut trainable_msgs, &mut trainable)?;
        if top > max_token.0 {
            max_token = (top, s.name);
        }
        let n = s.tokens.len();
        fields.push_sample(
            s.tokens,
            &trainable,
            width,
            opts.pad_token_id,
            opts.ignore_index,
        )?;
        attention_mask.extend(std::iter::repeat_n(true, n));
        attention_mask.extend(std::iter::repeat_n(false, width - n));
        lengths.push(as_i64(n, "lengths")?);
    }
    if (0..=max_token.0).contains(&opts.ignore_index) {
        return Err(ignore_index_error(
            opts.ignore_index,
            max_token.0,
            max_token.1,
        ));
    }
    Ok(PaddedLayout {
        rows,
        width,
        input_ids: fields.input_ids,
        labels: fields.labels,
        loss_mask: fields.loss_mask,
        token_mask: fields.token_mask,
        position_ids: fields.position_ids,
        attention_mask,
        lengths,
    })
}

/// Several packs (each checked with [`check_thd`]) as one THD micro-batch: their samples in
/// order, offsets shifted, the last sample padded up to `pad_to_length`. Of `opts`, the packs
/// must hold `pad_token_id` and `ignore_index` and be padded to the multiple of
/// `pad_to_multiple_of` and `cp_size`; the mask mode and roles are not read.
///
/// # Errors
/// `EmptyBatch` for no packs; `BatchLayout` naming the pack whose fields disagree or whose
/// samples are not padded to the multiple; `BatchOption` for options out of range or a
/// `pad_to_length` shorter than the packs; `IndexOverflow` past `i32::MAX` positions.
pub fn concat(parts: &[ThdView<'_>], opts: &BatchOptions) -> CoreResult<ThdLayout> {
    if parts.is_empty() {
        return Err(CoreError::EmptyBatch);
    }
    let layout = check_options(opts)?;
    layout.check_thd_target()?;
    let total = parts_total(parts)?;
    check_parts(parts, opts, layout.multiple)?;
    let mut extra = 0;
    if let Some(target) = layout.pad_to_length {
        if total > target {
            return Err(option_error(
                "pad_to_length",
                format!("the packs hold {total} positions, more than pad_to_length={target}"),
            ));
        }
        extra = target - total;
    }
    // `total + extra` is at most pad_to_length, itself at most THD_MAX.
    let cells = total + extra;
    let bytes = alloc::bytes_of::<u8>(cells).and_then(|b| b.checked_mul(BYTES_PER_POSITION));
    let refused = || layout.alloc_error(cells, bytes, extra > 0);
    alloc::probe(bytes, refused)?;
    let mut fields = Fields::with_capacity(cells, refused)?;
    let mut joined = append_parts(&mut fields, parts)?;
    if extra > 0 {
        let last_width = joined.last_width;
        fields.extend_last(last_width, extra, opts.pad_token_id, opts.ignore_index)?;
        let end = joined.end_padded + extra;
        if let Some(last) = joined.cu_seqlens_padded.last_mut() {
            *last = as_i32(end)?;
        }
        joined.max_seqlen = joined.max_seqlen.max(last_width + extra);
    }
    Ok(ThdLayout {
        input_ids: fields.input_ids,
        labels: fields.labels,
        loss_mask: fields.loss_mask,
        token_mask: fields.token_mask,
        position_ids: fields.position_ids,
        cu_seqlens: joined.cu_seqlens,
        cu_seqlens_padded: joined.cu_seqlens_padded,
        max_seqlen: joined.max_seqlen,
    })
}

/// The positions of all packs together. Computed first: checking each pack's fields reads
/// every position, so packs that can never fit int32 offsets are refused before that work,
/// not after it.
fn parts_total(parts: &[ThdView<'_>]) -> CoreResult<usize> {
    let mut total: usize = 0;
    for part in parts {
        total = total
            .checked_add(part.input_ids.len())
            .ok_or(CoreError::IndexOverflow {
                what: "micro-batch length",
            })?;
    }
    if total > THD_MAX {
        return Err(CoreError::IndexOverflow {
            what: "cu_seqlens (int32): the packs hold more positions than int32 offsets",
        });
    }
    Ok(total)
}

/// Each pack is a valid THD layout whose samples are padded to the micro-batch's `multiple`:
/// the joined offsets are taken as they are, so every sample must already have the padding
/// the micro-batch promises.
fn check_parts(parts: &[ThdView<'_>], opts: &BatchOptions, multiple: usize) -> CoreResult<()> {
    for (k, part) in parts.iter().enumerate() {
        check_thd(part, opts.pad_token_id, opts.ignore_index).map_err(|e| in_pack(k, e))?;
        let widths = part.cu_seqlens_padded.windows(2).map(|w| match w {
            [a, b] => usize::try_from(b - a).unwrap_or(0),
            _ => 0,
        });
        for (i, w) in widths.enumerate() {
            if w % multiple != 0 {
                return Err(CoreError::BatchLayout {
                    detail: format!(
                        "packs[{k}]: sample {i} is padded to {w} positions, not a multiple of \
                         {multiple}; build every pack with the micro-batch's \
                         pad_to_multiple_of and cp_size"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// The offsets of the packs appended by [`append_parts`], and what `concat` needs to pad
/// the last sample further.
struct Joined {
    cu_seqlens: Vec<i32>,
    cu_seqlens_padded: Vec<i32>,
    /// The last padded offset (the positions appended).
    end_padded: usize,
    max_seqlen: usize,
    /// The padded width of the last sample.
    last_width: usize,
}

/// Appends every pack's fields to `fields` and joins their offsets, each pack's shifted by
/// the positions before it.
fn append_parts(fields: &mut Fields, parts: &[ThdView<'_>]) -> CoreResult<Joined> {
    let mut cu_seqlens = vec![0i32];
    let mut cu_seqlens_padded = vec![0i32];
    let (mut base, mut base_padded) = (0usize, 0usize);
    let mut max_seqlen = 0;
    let mut last_width = 0;
    for part in parts {
        fields.input_ids.extend_from_slice(part.input_ids);
        fields.labels.extend_from_slice(part.labels);
        fields
            .loss_mask
            .extend(part.loss_mask.iter().map(|&b| b != 0));
        fields
            .token_mask
            .extend(part.token_mask.iter().map(|&b| b != 0));
        fields.position_ids.extend_from_slice(part.position_ids);
        for (&c, &cp) in part.cu_seqlens.iter().zip(part.cu_seqlens_padded).skip(1) {
            // Checked non-negative and non-decreasing by check_thd.
            let c = base + usize::try_from(c).unwrap_or(0);
            let cp = base_padded + usize::try_from(cp).unwrap_or(0);
            cu_seqlens.push(as_i32(c)?);
            cu_seqlens_padded.push(as_i32(cp)?);
        }
        base = cu_seqlens
            .last()
            .map_or(0, |&v| usize::try_from(v).unwrap_or(0));
        base_padded = cu_seqlens_padded
            .last()
            .map_or(0, |&v| usize::try_from(v).unwrap_or(0));
        max_seqlen = max_seqlen.max(part.max_seqlen);
        last_width = match part.cu_seqlens_padded {
            [.., a, b] => usize::try_from(b - a).unwrap_or(0),
            _ => 0,
        };
    }
    Ok(Joined {
        cu_seqlens,
        cu_seqlens_padded,
        end_padded: base_padded,
        max_seqlen,
        last_width,
    })
}

fn in_pack(k: usize, err: CoreError) -> CoreError {
    match err {
        CoreError::BatchLayout { detail } => CoreError::BatchLayout {
            detail: format!("packs[{k}]: {detail}"),
        },
        CoreError::BatchOption { name, detail } => CoreError::BatchOption {
            name,
            detail: format!("packs[{k}]: {detail}"),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests;
