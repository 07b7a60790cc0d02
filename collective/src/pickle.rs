//! A restricted pickle reader: the opcodes of protocols 2 to 5 read into a small value
//! tree, and nothing run. Every pickle arbor reads from a peer (a vLLM `ncclUniqueId`, a
//! barrier name, the CUDA IPC handles a trainer sends) goes through here.
//!
//! What it takes: `None`, bools, ints (up to 64 bits), floats, `str`, `bytes`, tuples,
//! lists, dicts, and globals from the caller's allow-list. A call of a global (`REDUCE`),
//! an object made by `NEWOBJ` and the state given to one by `BUILD` are kept as tagged
//! nodes: the callable is never imported or called, the caller reads the tree. Anything
//! else (a global off the allow-list, an out-of-band buffer, a set, a shared reference to
//! a mutable container, more nesting or more values than the limits) is refused with the
//! opcode and byte that broke it.

use std::collections::HashMap;

/// One value of a read pickle.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    /// Pairs in the order the pickle set them.
    Dict(Vec<(Value, Value)>),
    /// `module.name`, from the allow-list.
    Global(String, String),
    /// `func(*args)`, not run (`REDUCE`).
    Reduce(Box<Value>, Box<Value>),
    /// `cls.__new__(cls, *args)`, not run (`NEWOBJ`).
    NewObj(Box<Value>, Box<Value>),
    /// `obj.__setstate__(state)` or its `__dict__.update(state)`, not run (`BUILD`).
    Build(Box<Value>, Box<Value>),
}

impl Value {
    /// The global `module.name` this is, if it is one.
    pub fn global(&self) -> Option<(&str, &str)> {
        match self {
            Value::Global(m, n) => Some((m, n)),
            _ => None,
        }
    }

    /// A short description for errors: the kind, and a global's name.
    pub fn kind(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool(_) => "a bool".into(),
            Value::Int(_) => "an int".into(),
            Value::Float(_) => "a float".into(),
            Value::Str(_) => "a str".into(),
            Value::Bytes(_) => "bytes".into(),
            Value::Tuple(v) => format!("a tuple of {}", v.len()),
            Value::List(v) => format!("a list of {}", v.len()),
            Value::Dict(v) => format!("a dict of {}", v.len()),
            Value::Global(m, n) => format!("the global {m}.{n}"),
            Value::Reduce(f, _) => format!("a call of {}", f.kind()),
            Value::NewObj(c, _) => format!("an object of {}", c.kind()),
            Value::Build(o, _) => format!("{} with state", o.kind()),
        }
    }
}

/// Limits of one read.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most bytes of the pickle.
    pub max_bytes: usize,
    /// Deepest nesting of containers and calls.
    pub max_depth: usize,
    /// Most values in all (a memo read counts every value it copies).
    pub max_values: usize,
}

impl Limits {
    pub const fn new(max_bytes: usize) -> Self {
        Limits {
            max_bytes,
            max_depth: 32,
            max_values: 1 << 20,
        }
    }
}

/// Which globals a pickle may name.
pub trait Allow {
    fn allows(&self, module: &str, name: &str) -> bool;
}

impl<F: Fn(&str, &str) -> bool> Allow for F {
    fn allows(&self, module: &str, name: &str) -> bool {
        self(module, name)
    }
}

/// What a pickle did wrong, with where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PickleError(pub String);

type R<T> = Result<T, PickleError>;

fn err<T>(msg: impl Into<String>) -> R<T> {
    Err(PickleError(msg.into()))
}

/// A value on the stack with the depth of its nesting and the memo key it was stored
/// under; `Mark` is `MARK`.
#[derive(Debug)]
enum Slot {
    Mark,
    V(Value, usize, Option<u32>),
}

/// A memo entry: a copy of a value (with its depth and count), or the note that the value
/// changed after it was stored (a copy would miss the change: refused if read back).
enum Memo {
    V(Value, usize, usize),
    Changed(String),
}

struct Reader<'a, A: ?Sized> {
    b: &'a [u8],
    at: usize,
    /// Where the current opcode began (for errors).
    op_at: usize,
    op: u8,
    stack: Vec<Slot>,
    memo: HashMap<u32, Memo>,
    values: usize,
    limits: Limits,
    allow: &'a A,
}

/// The number of values in `v` (itself included).
fn count(v: &Value) -> usize {
    1 + match v {
        Value::Tuple(x) | Value::List(x) => x.iter().map(count).sum(),
        Value::Dict(x) => x.iter().map(|(k, v)| count(k) + count(v)).sum(),
        Value::Reduce(a, b) | Value::NewObj(a, b) | Value::Build(a, b) => count(a) + count(b),
        _ => 0,
    }
}

impl<A: Allow + ?Sized> Reader<'_, A> {
    fn fail<T>(&self, msg: impl std::fmt::Display) -> R<T> {
        err(format!(
            "opcode {:#04x} at byte {}: {msg}",
            self.op, self.op_at
        ))
    }

    fn take(&mut self, n: usize) -> R<&[u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| {
                PickleError(format!("truncated at byte {} (wants {n} more)", self.at))
            })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn uint(&mut self, n: usize) -> R<u64> {
        let s = self.take(n)?;
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(s);
        Ok(u64::from_le_bytes(v))
    }

    fn len(&mut self, n: usize) -> R<usize> {
        let v = self.uint(n)?;
        usize::try_from(v)
            .ok()
            .filter(|&l| l <= self.b.len())
            .map_or_else(|| self.fail(format!("a length of {v} bytes")), Ok)
    }

    fn text(&mut self, n: usize) -> R<String> {
        let s = self.take(n)?.to_vec();
        String::from_utf8(s).or_else(|_| self.fail("a string that is not UTF-8"))
    }

    fn push(&mut self, v: Value, depth: usize) -> R<()> {
        if depth > self.limits.max_depth {
            return self.fail(format!(
                "nesting deeper than {} values",
                self.limits.max_depth
            ));
        }
        self.values += 1;
        if self.values > self.limits.max_values {
            return self.fail(format!("more than {} values", self.limits.max_values));
        }
        self.stack.push(Slot::V(v, depth, None));
        Ok(())
    }

    fn leaf(&mut self, v: Value) -> R<()> {
        self.push(v, 1)
    }

    fn pop(&mut self) -> R<(Value, usize)> {
        self.pop_keyed().map(|(v, d, _)| (v, d))
    }

    fn pop_keyed(&mut self) -> R<(Value, usize, Option<u32>)> {
        match self.stack.pop() {
            Some(Slot::V(v, d, key)) => Ok((v, d, key)),
            Some(Slot::Mark) => self.fail("a MARK where a value should be"),
            None => self.fail("an empty stack"),
        }
    }

    /// The values since the last MARK (which goes).
    fn pop_mark(&mut self) -> R<(Vec<Value>, usize)> {
        let Some(m) = self.stack.iter().rposition(|s| matches!(s, Slot::Mark)) else {
            return self.fail("no MARK");
        };
        let mut depth = 0;
        let items = self
            .stack
            .drain(m..)
            .skip(1)
            .map(|s| match s {
                Slot::V(v, d, _) => {
                    depth = depth.max(d);
                    v
                }
                Slot::Mark => unreachable!("after the last mark"),
            })
            .collect();
        Ok((items, depth))
    }

    fn top_mut(&mut self) -> R<(&mut Value, &mut usize)> {
        if let Some(Slot::V(v, _, key)) = self.stack.last() {
            let (key, what) = (*key, v.kind());
            if let Some(k) = key {
                self.memo.insert(k, Memo::Changed(what));
            }
        }
        let (op, at) = (self.op, self.op_at);
        match self.stack.last_mut() {
            Some(Slot::V(v, d, _)) => Ok((v, d)),
            _ => err(format!("opcode {op:#04x} at byte {at}: no value to add to")),
        }
    }

    fn changed(&mut self, key: Option<u32>, v: &Value) {
        if let Some(k) = key {
            self.memo.insert(k, Memo::Changed(v.kind()));
        }
    }

    fn extend_list(&mut self, items: Vec<Value>, depth: usize) -> R<()> {
        let max = self.limits.max_depth;
        let (top, d) = self.top_mut()?;
        let Value::List(list) = top else {
            let k = top.kind();
            return self.fail(format!("APPEND to {k}, not a list"));
        };
        list.extend(items);
        *d = (*d).max(depth + 1);
        if *d > max {
            return self.fail(format!("nesting deeper than {max} values"));
        }
        Ok(())
    }

    fn extend_dict(&mut self, items: Vec<Value>, depth: usize) -> R<()> {
        if !items.len().is_multiple_of(2) {
            return self.fail("SETITEMS of an odd number of values");
        }
        let max = self.limits.max_depth;
        let (top, d) = self.top_mut()?;
        let Value::Dict(dict) = top else {
            let k = top.kind();
            return self.fail(format!("SETITEM on {k}, not a dict"));
        };
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            dict.push((k, v));
        }
        *d = (*d).max(depth + 1);
        if *d > max {
            return self.fail(format!("nesting deeper than {max} values"));
        }
        Ok(())
    }

    fn global(&mut self, module: String, name: String) -> R<()> {
        if !self.allow.allows(&module, &name) {
            return self.fail(format!(
                "the global {module}.{name}, which is not allowed here"
            ));
        }
        self.leaf(Value::Global(module, name))
    }

    fn memo_put(&mut self, key: u32) -> R<()> {
        let entry = match self.stack.last_mut() {
            Some(Slot::V(v, d, k)) => {
                *k = Some(key);
                Memo::V(v.clone(), *d, count(v))
            }
            _ => return self.fail("nothing to memoize"),
        };
        self.memo.insert(key, entry);
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> R<()> {
        match self.memo.get(&key) {
            Some(Memo::V(v, d, n)) => {
                let (v, d, n) = (v.clone(), *d, *n);
                // The copy's values count against the limit as the originals did.
                self.values += n - 1;
                self.push(v, d)?;
                if let Some(Slot::V(_, _, k)) = self.stack.last_mut() {
                    *k = Some(key);
                }
                Ok(())
            }
            Some(Memo::Changed(what)) => self.fail(format!(
                "a second reference to {what} changed after it was stored, which this reader does not follow"
            )),
            None => self.fail(format!("memo {key} was never stored")),
        }
    }

    fn run(&mut self) -> R<Value> {
        loop {
            self.op_at = self.at;
            self.op = self.take(1)?[0];
            match self.op {
                // FRAME: the length of what follows; nothing to check.
                0x95 => {
                    self.take(8)?;
                }
                b'.' => {
                    let (v, _) = self.pop()?;
                    if !self.stack.is_empty() {
                        return self.fail("STOP with more than one value on the stack");
                    }
                    if self.at != self.b.len() {
                        return err(format!("{} bytes after STOP", self.b.len() - self.at));
                    }
                    return Ok(v);
                }
                b'N' => self.leaf(Value::None)?,
                0x88 => self.leaf(Value::Bool(true))?,
                0x89 => self.leaf(Value::Bool(false))?,
                b'J' => {
                    let v = self.uint(4)? as u32 as i32;
                    self.leaf(Value::Int(v as i64))?
                }
                b'K' => {
                    let v = self.uint(1)?;
                    self.leaf(Value::Int(v as i64))?
                }
                b'M' => {
                    let v = self.uint(2)?;
                    self.leaf(Value::Int(v as i64))?
                }
                // LONG1 / LONG4: little-endian two's complement of n bytes.
                0x8a | 0x8b => {
                    let n = if self.op == 0x8a {
                        self.len(1)?
                    } else {
                        self.len(4)?
                    };
                    if n > 8 {
                        return self.fail(format!("an int of {n} bytes (more than 64 bits)"));
                    }
                    let s = self.take(n)?;
                    let neg = s.last().is_some_and(|&x| x & 0x80 != 0);
                    let mut v = [if neg { 0xff } else { 0 }; 8];
                    v[..n].copy_from_slice(s);
                    self.leaf(Value::Int(i64::from_le_bytes(v)))?
                }
                b'G' => {
                    let s = self.take(8)?;
                    let v = f64::from_be_bytes(s.try_into().expect("8 bytes"));
                    self.leaf(Value::Float(v))?
                }
                0x8c | b'X' | 0x8d => {
                    let n = match self.op {
                        0x8c => self.len(1)?,
                        b'X' => self.len(4)?,
                        _ => self.len(8)?,
                    };
                    let s = self.text(n)?;
                    self.leaf(Value::Str(s))?
                }
                b'C' | b'B' | 0x8e | 0x96 => {
                    let n = match self.op {
                        b'C' => self.len(1)?,
                        b'B' => self.len(4)?,
                        _ => self.len(8)?,
                    };
                    let s = self.take(n)?.to_vec();
                    self.leaf(Value::Bytes(s))?
                }
                b')' => self.leaf(Value::Tuple(Vec::new()))?,
                0x85..=0x87 => {
                    let n = (self.op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    let mut depth = 0;
                    for _ in 0..n {
                        let (v, d) = self.pop()?;
                        depth = depth.max(d);
                        items.push(v);
                    }
                    items.reverse();
                    self.push(Value::Tuple(items), depth + 1)?;
                }
                b'(' => self.stack.push(Slot::Mark),
                b't' => {
                    let (items, depth) = self.pop_mark()?;
                    self.push(Value::Tuple(items), depth + 1)?
                }
                b']' => self.leaf(Value::List(Vec::new()))?,
                b'l' => {
                    let (items, depth) = self.pop_mark()?;
                    self.push(Value::List(items), depth + 1)?
                }
                b'a' => {
                    let (v, d) = self.pop()?;
                    self.extend_list(vec![v], d)?
                }
                b'e' => {
                    let (items, d) = self.pop_mark()?;
                    self.extend_list(items, d)?
                }
                b'}' => self.leaf(Value::Dict(Vec::new()))?,
                b'd' => {
                    let (items, d) = self.pop_mark()?;
                    self.leaf(Value::Dict(Vec::new()))?;
                    self.extend_dict(items, d)?
                }
                b's' => {
                    let (v, dv) = self.pop()?;
                    let (k, dk) = self.pop()?;
                    self.extend_dict(vec![k, v], dk.max(dv))?
                }
                b'u' => {
                    let (items, d) = self.pop_mark()?;
                    self.extend_dict(items, d)?
                }
                b'c' => {
                    let mut parts = [String::new(), String::new()];
                    for p in &mut parts {
                        let rest = &self.b[self.at..];
                        let Some(nl) = rest.iter().position(|&c| c == b'\n') else {
                            return self.fail("GLOBAL without its newline");
                        };
                        *p = self.text(nl)?;
                        self.at += 1;
                    }
                    let [m, n] = parts;
                    self.global(m, n)?
                }
                0x93 => {
                    let (name, _) = self.pop()?;
                    let (module, _) = self.pop()?;
                    match (module, name) {
                        (Value::Str(m), Value::Str(n)) => {
                            self.values -= 2;
                            self.global(m, n)?
                        }
                        _ => return self.fail("STACK_GLOBAL of values that are not strings"),
                    }
                }
                b'R' | 0x81 | b'b' => {
                    let (arg, da) = self.pop()?;
                    let (f, df, key) = self.pop_keyed()?;
                    if self.op == b'b' {
                        // BUILD changes the object: a memo copy of it would miss the state.
                        self.changed(key, &f);
                    }
                    let (a, b) = (Box::new(f), Box::new(arg));
                    let v = match self.op {
                        b'R' => match (&*a, &*b) {
                            // Protocol 2's bytes: `_codecs.encode(text, "latin1")`.
                            (Value::Global(m, n), Value::Tuple(t))
                                if m == "_codecs" && n == "encode" =>
                            {
                                match t.as_slice() {
                                    [Value::Str(s), Value::Str(enc)] if enc == "latin1" => {
                                        let bytes: Option<Vec<u8>> = s
                                            .chars()
                                            .map(|c| u8::try_from(c as u32).ok())
                                            .collect();
                                        match bytes {
                                            Some(b) => Value::Bytes(b),
                                            None => {
                                                return self
                                                    .fail("latin1 bytes of a character above 255")
                                            }
                                        }
                                    }
                                    _ => {
                                        return self
                                            .fail("_codecs.encode of other than (str, \"latin1\")")
                                    }
                                }
                            }
                            (Value::Global(..), _) => Value::Reduce(a, b),
                            (other, _) => {
                                return self
                                    .fail(format!("REDUCE of {}, not a global", other.kind()))
                            }
                        },
                        0x81 => match &*a {
                            Value::Global(..) => Value::NewObj(a, b),
                            other => {
                                return self
                                    .fail(format!("NEWOBJ of {}, not a global", other.kind()))
                            }
                        },
                        _ => Value::Build(a, b),
                    };
                    self.values -= 1;
                    self.push(v, da.max(df) + 1)?
                }
                0x94 => {
                    let key = self.memo.len() as u32;
                    self.memo_put(key)?
                }
                b'q' => {
                    let key = self.uint(1)? as u32;
                    self.memo_put(key)?
                }
                b'r' => {
                    let key = self.uint(4)? as u32;
                    self.memo_put(key)?
                }
                b'h' => {
                    let key = self.uint(1)? as u32;
                    self.memo_get(key)?
                }
                b'j' => {
                    let key = self.uint(4)? as u32;
                    self.memo_get(key)?
                }
                b'0' => {
                    self.stack.pop();
                }
                b'1' => {
                    self.pop_mark()?;
                }
                other => {
                    return self.fail(format!(
                        "{}, which this reader does not take",
                        match other {
                            0x80 => "PROTO after the start",
                            0x97 | 0x98 => "an out-of-band buffer",
                            0x8f..=0x91 => "a set",
                            0x92 => "NEWOBJ_EX",
                            _ => "an opcode of protocols 0 and 1 or none",
                        }
                    ))
                }
            }
        }
    }
}

/// Reads the pickle `b` (protocols 2 to 5) into a value tree; globals must pass `allow`.
pub fn read(b: &[u8], allow: &(impl Allow + ?Sized), limits: Limits) -> Result<Value, PickleError> {
    if b.len() > limits.max_bytes {
        return err(format!(
            "{} bytes, more than the {} this pickle may take",
            b.len(),
            limits.max_bytes
        ));
    }
    match b {
        [0x80, 2..=5, ..] => {}
        _ => {
            return err(format!(
                "starts with {:02x?}, not a pickle of protocol 2 to 5",
                &b[..b.len().min(2)]
            ))
        }
    }
    let mut r = Reader {
        b,
        at: 2,
        op_at: 2,
        op: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
        values: 0,
        limits,
        allow,
    };
    r.run()
}

/// The protocol a pickle declares (its second byte), if it starts as one.
pub fn protocol(b: &[u8]) -> Option<u8> {
    match b {
        [0x80, p, ..] => Some(*p),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    const NONE: fn(&str, &str) -> bool = |_, _| false;

    /// `pickle.dumps((1, -2, 300, 70000, 2**40, -2**63, 1.5, True, None, "é", b"ab",
    /// [1, 2], {"k": [3]}, ("s", "s")), protocol=4)` (CPython 3.11): the second "s" is a
    /// memo read.
    #[test]
    fn reads_what_python_writes() {
        let b = hex("8004955600000000000000284b014afeffffff4d2c014a701101008a060000000000018a080000000000000080473ff8000000000000884e8c02c3a99443026162945d94284b014b02657d948c016b945d944b0361738c0173946806869474942e");
        let v = read(&b, &NONE, Limits::new(1 << 10)).unwrap();
        let s = || Value::Str("s".into());
        assert_eq!(
            v,
            Value::Tuple(vec![
                Value::Int(1),
                Value::Int(-2),
                Value::Int(300),
                Value::Int(70000),
                Value::Int(1 << 40),
                Value::Int(i64::MIN),
                Value::Float(1.5),
                Value::Bool(true),
                Value::None,
                Value::Str("é".into()),
                Value::Bytes(b"ab".to_vec()),
                Value::List(vec![Value::Int(1), Value::Int(2)]),
                Value::Dict(vec![(
                    Value::Str("k".into()),
                    Value::List(vec![Value::Int(3)])
                )]),
                Value::Tuple(vec![s(), s()]),
            ])
        );
    }

    fn p(ops: &[u8]) -> Vec<u8> {
        [&[0x80, 4][..], ops, b"."].concat()
    }

    #[test]
    fn reads_each_opcode() {
        // (1, -2, 300, 2**40, -1 as LONG1, 1.5, True, None, "é", b"ab", [1, 2], {"k": 3})
        let mut ops = vec![b'('];
        ops.extend_from_slice(&[b'K', 1]);
        ops.push(b'J');
        ops.extend_from_slice(&(-2i32).to_le_bytes());
        ops.extend_from_slice(&[b'M', 0x2c, 0x01]);
        ops.extend_from_slice(&[0x8a, 6, 0, 0, 0, 0, 0, 1]);
        ops.extend_from_slice(&[0x8a, 1, 0xff]);
        ops.push(b'G');
        ops.extend_from_slice(&1.5f64.to_be_bytes());
        ops.extend_from_slice(&[0x88, b'N', 0x8c, 2, 0xc3, 0xa9, b'C', 2, b'a', b'b']);
        ops.extend_from_slice(&[b']', 0x94, b'(', b'K', 1, b'K', 2, b'e']);
        ops.extend_from_slice(&[b'}', 0x8c, 1, b'k', b'K', 3, b's', b't']);
        let v = read(&p(&ops), &NONE, Limits::new(1 << 10)).unwrap();
        assert_eq!(
            v,
            Value::Tuple(vec![
                Value::Int(1),
                Value::Int(-2),
                Value::Int(300),
                Value::Int(1 << 40),
                Value::Int(-1),
                Value::Float(1.5),
                Value::Bool(true),
                Value::None,
                Value::Str("é".into()),
                Value::Bytes(b"ab".to_vec()),
                Value::List(vec![Value::Int(1), Value::Int(2)]),
                Value::Dict(vec![(Value::Str("k".into()), Value::Int(3))]),
            ])
        );
    }

    #[test]
    fn memo_copies_values_and_refuses_shared_lists() {
        // (s, s) with s memoized, then read back.
        let ops = [0x8c, 1, b's', 0x94, b'h', 0, 0x86];
        let v = read(&p(&ops), &NONE, Limits::new(64)).unwrap();
        assert_eq!(
            v,
            Value::Tuple(vec![Value::Str("s".into()), Value::Str("s".into())])
        );
        let ops = [b']', 0x94, b'N', b'a', b'h', 0, 0x86];
        let e = read(&p(&ops), &NONE, Limits::new(64)).unwrap_err();
        assert!(
            e.0.contains("second reference to a list of 0 changed"),
            "{e}"
        );
        let e = read(&p(&[b'h', 7]), &NONE, Limits::new(64)).unwrap_err();
        assert!(e.0.contains("memo 7 was never stored"), "{e}");
    }

    #[test]
    fn globals_only_from_the_allow_list() {
        let ops = [
            0x8c, 2, b'o', b's', 0x8c, 6, b's', b'y', b's', b't', b'e', b'm', 0x93, 0x8c, 2, b'l',
            b's', 0x85, b'R',
        ];
        let e = read(&p(&ops), &NONE, Limits::new(64)).unwrap_err();
        assert!(
            e.0.contains("the global os.system, which is not allowed"),
            "{e}"
        );
        let allow = |m: &str, n: &str| m == "os" && n == "system";
        let v = read(&p(&ops), &allow, Limits::new(64)).unwrap();
        assert_eq!(
            v,
            Value::Reduce(
                Box::new(Value::Global("os".into(), "system".into())),
                Box::new(Value::Tuple(vec![Value::Str("ls".into())]))
            )
        );
    }

    #[test]
    fn limits_and_malformed_input() {
        let deep: Vec<u8> = std::iter::repeat_n(b']', 40)
            .chain(std::iter::repeat_n(b'a', 39))
            .collect();
        let e = read(&p(&deep), &NONE, Limits::new(1 << 10)).unwrap_err();
        assert!(e.0.contains("nesting deeper than 32"), "{e}");
        let many: Vec<u8> = [b'(']
            .into_iter()
            .chain(std::iter::repeat_n(b'N', 100))
            .chain([b't'])
            .collect();
        let small = Limits {
            max_values: 50,
            ..Limits::new(1 << 10)
        };
        assert!(read(&p(&many), &NONE, small)
            .unwrap_err()
            .0
            .contains("more than 50 values"));
        // Each memo read counts the values it copies.
        let mut copies = vec![b'(', b'(', b'N', b'N', b'N', b't', 0x94];
        copies.extend(std::iter::repeat_n([b'h', 0], 20).flatten());
        copies.push(b't');
        assert!(read(&p(&copies), &NONE, small)
            .unwrap_err()
            .0
            .contains("more than 50 values"));
        assert!(read(&[0x80, 4, b'N'], &NONE, Limits::new(8))
            .unwrap_err()
            .0
            .contains("truncated"));
        assert!(read(&[0x80, 1, b'N', b'.'], &NONE, Limits::new(8))
            .unwrap_err()
            .0
            .contains("protocol 2 to 5"));
        assert!(read(&[0x80, 4, b'N', b'N', b'.'], &NONE, Limits::new(8))
            .unwrap_err()
            .0
            .contains("more than one value"));
        assert!(read(&[0x80, 4, b'N', b'.', 0], &NONE, Limits::new(8))
            .unwrap_err()
            .0
            .contains("1 bytes after STOP"));
        assert!(read(&[0x80, 4, 0x97, b'.'], &NONE, Limits::new(8))
            .unwrap_err()
            .0
            .contains("out-of-band"));
        assert!(read(&p(b"a"), &NONE, Limits::new(8))
            .unwrap_err()
            .0
            .contains("empty stack"));
        assert!(read(&[0x80, 4, b'N', b'.'], &NONE, Limits::new(3))
            .unwrap_err()
            .0
            .contains("more than the 3"));
    }

    #[test]
    fn protocol_2_bytes() {
        // pickle.dumps(b"\xff\x01", protocol=2) (CPython 3.11).
        let b = hex("8002635f636f646563730a656e636f64650a71005803000000c3bf01710158060000006c6174696e3171028671035271042e");
        let allow = |m: &str, n: &str| m == "_codecs" && n == "encode";
        assert_eq!(
            read(&b, &allow, Limits::new(64)).unwrap(),
            Value::Bytes(vec![0xff, 0x01])
        );
    }
}
