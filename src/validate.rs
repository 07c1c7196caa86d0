//! One validator for the buffers a caller hands to any operation: device, length, overlap.
//!
//! An operation describes each buffer as an [`Operand`] — its name as the API spells it, device
//! address, length, element size, [`Role`] (read or written) and [`Need`] (the length it must
//! have) — and checks the whole list with one call ([`check`]); the error is an
//! [`Error::InvalidArgument`] naming the argument. [`Binder`] builds the list from cudarc
//! buffers: it checks each buffer's device *before* taking its address (taking the address of
//! another device's buffer would make the Context's stream wait on a foreign event) and keeps
//! the stream-ordering guards alive while the operation launches.
//!
//! The rules, in the order they are checked:
//! 1. device: every buffer lives on the Context's device (at bind time, in bind order);
//! 2. lengths, in list order ([`Need`]);
//! 3. overlap ([`Aliasing`]), on the bytes the call touches: of two operands that share a byte,
//!    the later one in the list is named, unless both are data that is only read (inputs may
//!    overlap any way they like) or the pair is an allowed in-place alias covering exactly the
//!    same bytes. A mask never overlaps anything.
//!
//! `BufInfo` and the `expect_*` functions are the same rules one at a time, kept for the cuDNN
//! graph layer (`cudnn_graph/graph_conv.rs`), which has not moved to [`Operand`] lists yet, and
//! for the bad-input test's pure device check. All of it is pure arithmetic on lengths and
//! address ranges except [`Binder`], so it is tested on the CPU.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::reference::activation::mask_words;

/// Whether the operation reads or writes a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Only read.
    Input,
    /// Written (possibly also read).
    Output,
}

/// The length an operand must have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Need {
    /// Exactly this many elements; the text says where the number comes from ("the plan's
    /// shape"). The whole buffer counts as touched.
    Exactly(usize, &'static str),
    /// Exactly this many elements, the text being the formula that gives it (`n*c_in*h*w`):
    /// the error reads "length L, expected FORMULA = N". The whole buffer counts as touched.
    Formula(usize, &'static str),
    /// At least the extent a strided operation reaches (checked by the operation itself, e.g.
    /// GEMM's batches); only these many elements from the base are touched, and an overlap
    /// error shows both spans.
    Span(usize),
    /// Elementwise data: the length of the list's first `Same` operand, which defines the call's
    /// element count `n`.
    Same,
    /// A bitmask of `n` elements: at least `mask_words(n)` `u32` words; only those are touched.
    MaskFor,
}

/// One buffer argument of a call, as validation sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Operand {
    /// The argument's name in the public API (`x`, `y`, `mask`, ...).
    pub name: &'static str,
    /// Device address of its first element.
    pub ptr: u64,
    /// Length in elements (words for a mask).
    pub len: usize,
    /// Bytes per element.
    pub elem_bytes: usize,
    /// Read or written.
    pub role: Role,
    /// The length it must have.
    pub need: Need,
}

impl Operand {
    /// Elementwise activation data of the call's length ([`Need::Same`]).
    #[cfg(test)]
    pub(crate) fn data(
        name: &'static str,
        ptr: u64,
        len: usize,
        elem_bytes: usize,
        writes: bool,
    ) -> Self {
        let role = if writes { Role::Output } else { Role::Input };
        Operand {
            name,
            ptr,
            len,
            elem_bytes,
            role,
            need: Need::Same,
        }
    }

    /// A bitmask (`u32` words) of the call's elements ([`Need::MaskFor`]).
    #[cfg(test)]
    pub(crate) fn mask(name: &'static str, ptr: u64, len: usize, writes: bool) -> Self {
        Operand {
            need: Need::MaskFor,
            ..Operand::data(name, ptr, len, 4, writes)
        }
    }

    fn is_mask(&self) -> bool {
        self.need == Need::MaskFor
    }

    /// The bytes a call over `n` elements touches: `[start, end)`.
    fn touched(&self, n: usize) -> (u64, u64) {
        let count = match self.need {
            Need::MaskFor => mask_words(n),
            Need::Span(span) => span,
            _ => self.len,
        };
        let bytes = (count as u64).saturating_mul(self.elem_bytes as u64);
        (self.ptr, self.ptr.saturating_add(bytes))
    }
}

/// Which outputs may share memory with another operand.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Aliasing<'a> {
    /// None: every output is distinct from every other operand (BatchNorm, convolution, ...).
    Distinct,
    /// Elementwise calls: an output may be exactly the same bytes as a partner listed here
    /// (either order) — in place; any other overlap with an output or a mask is refused.
    InPlace(&'a [(&'a str, &'a str)]),
}

/// The lengths of `ops` (rule 2); returns the element count `n` of the [`Need::Same`] operands
/// (0 when there are none).
pub(crate) fn check_lengths(ops: &[Operand]) -> Result<usize> {
    let first = ops.iter().find(|o| o.need == Need::Same);
    let n = first.map_or(0, |f| f.len);
    for o in ops {
        match o.need {
            Need::Exactly(want, what) => expect_count(o.name, o.len, want, what)?,
            Need::Formula(want, formula) if o.len != want => {
                return Err(Error::invalid(
                    o.name,
                    format!("length {}, expected {formula} = {want}", o.len),
                ))
            }
            Need::Same if o.len != n => {
                return Err(Error::invalid(
                    o.name,
                    format!(
                        "length {}, expected {n} (the length of `{}`)",
                        o.len,
                        first.map_or("", |f| f.name)
                    ),
                ))
            }
            Need::Same | Need::MaskFor | Need::Formula(..) | Need::Span(_) => {}
        }
    }
    for o in ops.iter().filter(|o| o.is_mask()) {
        let need = mask_words(n);
        if o.len < need {
            return Err(Error::invalid(
                o.name,
                format!(
                    "length {} words, expected at least {need} (ceil({n} / 32)) for {n} elements",
                    o.len
                ),
            ));
        }
    }
    Ok(n)
}

/// The overlap rule (rule 3) for a call over `n` elements.
pub(crate) fn check_overlaps(ops: &[Operand], n: usize, aliasing: Aliasing<'_>) -> Result<()> {
    for (j, b) in ops.iter().enumerate() {
        for a in &ops[..j] {
            let (a0, a1) = a.touched(n);
            let (b0, b1) = b.touched(n);
            if a1 <= b0 || b1 <= a0 {
                continue;
            }
            let mask = a.is_mask() || b.is_mask();
            if a.role == Role::Input && b.role == Role::Input && !mask {
                continue;
            }
            let exact = a0 == b0 && a1 == b1;
            let reason = match aliasing {
                Aliasing::Distinct if matches!(b.need, Need::Span(_)) => {
                    spans_overlap(b.name, a.name, (b0, b1), (a0, a1))
                }
                Aliasing::Distinct => not_distinct(a.name),
                Aliasing::InPlace(pairs) => {
                    let listed = pairs.iter().any(|&(p, q)| {
                        (p == a.name && q == b.name) || (p == b.name && q == a.name)
                    });
                    if exact && listed {
                        continue;
                    }
                    in_place_refusal(a.name, (a0, a1), (b0, b1), exact, mask)
                }
            };
            return Err(Error::invalid(b.name, reason));
        }
    }
    Ok(())
}

/// Lengths, then overlaps: the whole list in one call. Returns `n` (see [`check_lengths`]).
pub(crate) fn check(ops: &[Operand], aliasing: Aliasing<'_>) -> Result<usize> {
    let n = check_lengths(ops)?;
    check_overlaps(ops, n, aliasing)?;
    Ok(n)
}

fn not_distinct(other: &str) -> String {
    format!("overlaps `{other}` in device memory; they must be distinct")
}

/// A strided output over an input's span (GEMM's wording: both byte ranges).
fn spans_overlap(out: &str, other: &str, (o0, o1): (u64, u64), (a0, a1): (u64, u64)) -> String {
    format!(
        "overlaps `{other}` ({out} spans {o0:#x}..{o1:#x}, {other} spans {a0:#x}..{a1:#x}): \
         the output must not alias an input"
    )
}

fn in_place_refusal(
    other: &str,
    (a0, a1): (u64, u64),
    (b0, b1): (u64, u64),
    exact: bool,
    mask: bool,
) -> String {
    if exact {
        format!(
            "is the same memory as `{other}` ({a0:#x}..{a1:#x}), which this call does not \
             allow{}",
            if mask {
                ": the mask must not overlap the data"
            } else {
                ""
            }
        )
    } else {
        format!(
            "overlaps `{other}` ({b0:#x}..{b1:#x} and {a0:#x}..{a1:#x}); buffers may only \
             coincide exactly, and only where the call documents it (in place){}",
            if mask {
                "; the mask must not overlap the data"
            } else {
                ""
            }
        )
    }
}

/// Builds an operand list from cudarc buffers on the Context's stream: checks each buffer's
/// device before it takes the address, and holds the stream-ordering guards until dropped (keep
/// it alive until the launch is queued).
pub(crate) struct Binder<'a> {
    ordinal: usize,
    stream: &'a CudaStream,
    ops: Vec<Operand>,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Binder<'a> {
    /// An empty list for `ctx`'s device and stream.
    pub(crate) fn new(ctx: &'a Context) -> Self {
        Binder {
            ordinal: ctx.info().ordinal,
            stream: ctx.stream(),
            ops: Vec::with_capacity(8),
            guards: Vec::with_capacity(8),
        }
    }

    fn device<T, S: DeviceSlice<T>>(&self, name: &'static str, buf: &S) -> Result<()> {
        expect_ordinal(name, buf.stream().context().ordinal(), self.ordinal)
    }

    fn push<T>(&mut self, name: &'static str, ptr: u64, len: usize, role: Role, need: Need) {
        self.ops.push(Operand {
            name,
            ptr,
            len,
            elem_bytes: std::mem::size_of::<T>(),
            role,
            need,
        });
    }

    /// A buffer the call reads; returns its device address.
    pub(crate) fn input<T, S: DevicePtr<T>>(
        &mut self,
        name: &'static str,
        buf: &'a S,
        need: Need,
    ) -> Result<u64> {
        self.shared(name, buf, Role::Input, need)
    }

    /// A buffer the call writes; returns its device address.
    pub(crate) fn output<T, S: DevicePtrMut<T>>(
        &mut self,
        name: &'static str,
        buf: &'a mut S,
        need: Need,
    ) -> Result<u64> {
        crate::profile::stage!(Validate);
        self.device(name, &*buf)?;
        let len = buf.len();
        let (ptr, guard) = {
            crate::profile::stage!(Events);
            buf.device_ptr_mut(self.stream)
        };
        self.guards.push(guard);
        self.push::<T>(name, ptr, len, Role::Output, need);
        Ok(ptr)
    }

    /// A buffer the call treats as written but borrows shared, because nothing is written
    /// through it here (a GEMM key computed for these operands): checked as an output.
    pub(crate) fn output_ref<T, S: DevicePtr<T>>(
        &mut self,
        name: &'static str,
        buf: &'a S,
        need: Need,
    ) -> Result<u64> {
        self.shared(name, buf, Role::Output, need)
    }

    /// Binds a buffer borrowed shared in `role`; returns its device address.
    fn shared<T, S: DevicePtr<T>>(
        &mut self,
        name: &'static str,
        buf: &'a S,
        role: Role,
        need: Need,
    ) -> Result<u64> {
        crate::profile::stage!(Validate);
        self.device(name, buf)?;
        let (ptr, guard) = {
            crate::profile::stage!(Events);
            buf.device_ptr(self.stream)
        };
        self.guards.push(guard);
        self.push::<T>(name, ptr, buf.len(), role, need);
        Ok(ptr)
    }

    /// The operands bound so far, in bind order.
    pub(crate) fn operands(&self) -> &[Operand] {
        &self.ops
    }

    /// [`check`] over the bound operands.
    pub(crate) fn check(&self, aliasing: Aliasing<'_>) -> Result<usize> {
        crate::profile::stage!(Validate);
        check(&self.ops, aliasing)
    }
}

impl Drop for Binder<'_> {
    fn drop(&mut self) {
        // The guards record cudarc's read/write events (when it tracks them): timed as such.
        crate::profile::stage!(Events);
        self.guards.clear();
    }
}

/// What the one-at-a-time checks need to know about one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufInfo {
    /// The argument's name, as the API spells it.
    pub name: &'static str,
    /// Device address of the first element.
    pub ptr: u64,
    /// Elements.
    pub len: usize,
    /// Bytes per element.
    pub elem: usize,
    /// Device ordinal the buffer lives on.
    pub ordinal: usize,
}

impl BufInfo {
    /// `[ptr, ptr + len * elem)`.
    pub fn range(&self) -> (u64, u64) {
        (self.ptr, self.ptr + (self.len * self.elem) as u64)
    }
}

fn expect_count(name: &'static str, len: usize, want: usize, what: &str) -> Result<()> {
    if len != want {
        return Err(Error::invalid(
            name,
            format!("has {len} elements, expected {want} ({what})"),
        ));
    }
    Ok(())
}

fn expect_ordinal(name: &'static str, ordinal: usize, context: usize) -> Result<()> {
    if ordinal != context {
        return Err(Error::invalid(
            name,
            format!("lives on device {ordinal}, but the Context runs on device {context}"),
        ));
    }
    Ok(())
}

/// `buf.len == want`.
pub fn expect_len(buf: &BufInfo, want: usize, what: &str) -> Result<()> {
    expect_count(buf.name, buf.len, want, what)
}

/// The buffer lives on the Context's device.
pub fn expect_device(buf: &BufInfo, ordinal: usize) -> Result<()> {
    expect_ordinal(buf.name, buf.ordinal, ordinal)
}

/// Whether two buffers share any byte (empty buffers share none).
pub fn overlaps(a: &BufInfo, b: &BufInfo) -> bool {
    let (a0, a1) = a.range();
    let (b0, b1) = b.range();
    a0 < b1 && b0 < a1
}

/// `out` must not share memory with `other`; the error names `out`.
pub fn expect_disjoint(out: &BufInfo, other: &BufInfo) -> Result<()> {
    if overlaps(out, other) {
        return Err(Error::invalid(out.name, not_distinct(other.name)));
    }
    Ok(())
}

/// Every output is disjoint from every other buffer (inputs and other outputs).
pub fn expect_outputs_disjoint(outputs: &[BufInfo], inputs: &[BufInfo]) -> Result<()> {
    for (i, o) in outputs.iter().enumerate() {
        for other in outputs[..i].iter().chain(inputs) {
            expect_disjoint(o, other)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(name: &'static str, ptr: u64, len: usize) -> BufInfo {
        BufInfo {
            name,
            ptr,
            len,
            elem: 4,
            ordinal: 0,
        }
    }

    #[test]
    fn overlap_is_half_open() {
        assert!(!overlaps(&b("a", 0, 4), &b("b", 16, 4)));
        assert!(overlaps(&b("a", 0, 5), &b("b", 16, 4)));
        assert!(overlaps(&b("a", 16, 1), &b("b", 16, 1)));
        assert!(!overlaps(&b("a", 16, 0), &b("b", 16, 4)));
    }

    #[test]
    fn errors_name_the_output() {
        let e = expect_outputs_disjoint(&[b("y", 100, 10)], &[b("x", 96, 4)]).unwrap_err();
        assert_eq!(e.argument(), Some("y"));
        assert!(e.to_string().contains("`x`"));
        let e = expect_outputs_disjoint(&[b("dx", 0, 4), b("dz", 8, 4)], &[]).unwrap_err();
        assert_eq!(e.argument(), Some("dz"));
        assert!(expect_outputs_disjoint(&[b("y", 0, 4)], &[b("x", 16, 4)]).is_ok());
        let e = expect_len(&b("gamma", 0, 3), 4, "C").unwrap_err();
        assert_eq!(e.argument(), Some("gamma"));
        let mut g = b("gamma", 0, 4);
        g.ordinal = 1;
        assert_eq!(expect_device(&g, 0).unwrap_err().argument(), Some("gamma"));
    }

    fn op(name: &'static str, ptr: u64, len: usize, role: Role, need: Need) -> Operand {
        Operand {
            name,
            ptr,
            len,
            elem_bytes: 4,
            role,
            need,
        }
    }

    #[test]
    fn one_list_names_the_argument() {
        use Role::*;
        let c = Need::Exactly(4, "C");
        let n = Need::Exactly(16, "the plan's shape");
        let ops = [
            op("x", 0x1000, 16, Input, n),
            op("gamma", 0x1000, 4, Input, c), // inputs may overlap
            op("y", 0x2000, 16, Output, n),
            op("running_mean", 0x3000, 4, Output, c),
        ];
        assert_eq!(check(&ops, Aliasing::Distinct).unwrap(), 0);
        let mut bad = ops;
        bad[3].len = 3;
        let e = check(&bad, Aliasing::Distinct).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument `running_mean`: has 3 elements, expected 4 (C)"
        );
        let mut bad = ops;
        bad[2].ptr = 0x1008; // y inside x
        let e = check(&bad, Aliasing::Distinct).unwrap_err();
        assert_eq!(e.argument(), Some("y"));
        assert!(e
            .to_string()
            .ends_with("overlaps `x` in device memory; they must be distinct"));
        let mut bad = ops;
        bad[3].ptr = 0x2000; // two outputs
        let e = check(&bad, Aliasing::Distinct).unwrap_err();
        assert_eq!(e.argument(), Some("running_mean"));
        // An exact alias is refused unless the call allows it in place.
        let same = [
            op("x", 0x1000, 16, Input, Need::Same),
            op("y", 0x1000, 16, Output, Need::Same),
        ];
        assert!(check(&same, Aliasing::Distinct).is_err());
        assert!(check(&same, Aliasing::InPlace(&[("x", "y")])).is_ok());
        assert_eq!(
            check(&same, Aliasing::InPlace(&[])).unwrap_err().argument(),
            Some("y")
        );
    }

    #[test]
    fn formula_and_span_needs() {
        use Role::*;
        let ops = [
            op("x", 0x1000, 10, Input, Need::Formula(12, "n*c_in*h*w")),
            op(
                "cols",
                0x2000,
                4,
                Output,
                Need::Formula(4, "n*oh*ow*c_in*kh*kw"),
            ),
        ];
        let e = check(&ops, Aliasing::Distinct).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument `x`: length 10, expected n*c_in*h*w = 12"
        );
        // A span touches only its extent: c starts right after a's 100 elements.
        let spans = [
            op("a", 0x1000, 1000, Input, Need::Span(100)),
            op("b", 0x1000, 100, Input, Need::Span(100)),
            op("c", 0x1190, 100, Output, Need::Span(100)),
        ];
        assert!(check(&spans, Aliasing::Distinct).is_ok());
        let mut bad = spans;
        bad[2].ptr = 0x1188;
        let e = check(&bad, Aliasing::Distinct).unwrap_err();
        assert_eq!(e.argument(), Some("c"));
        assert!(
            e.to_string().ends_with(
                "overlaps `a` (c spans 0x1188..0x1318, a spans 0x1000..0x1190): the output \
                 must not alias an input"
            ),
            "{e}"
        );
    }
}
