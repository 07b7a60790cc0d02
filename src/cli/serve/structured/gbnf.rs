//! GBNF, the grammar syntax of llama.cpp that SGLang's `ebnf` and vLLM's `grammar` take
//! (`root ::= ...`), written as llguidance's Lark syntax. The llguidance crate reads only
//! Lark; its Python package converts GBNF the same way before compiling, so a grammar
//! either server accepts is accepted here.
//!
//! Every GBNF rule becomes a Lark rule (`root` becomes `start`), every literal a Lark
//! string, every character class and `.` a one-character regex: the rules keep their
//! context-free meaning, with no lexing decision that GBNF does not make.

use std::collections::HashMap;
use std::fmt::Write;

/// Whether `text` is GBNF rather than Lark: its first rule is written `name ::= ...`.
pub fn is_gbnf(text: &str) -> bool {
    let Some(line) = text
        .lines()
        .map(str::trim_start)
        .find(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with("//"))
    else {
        return false;
    };
    let name_end = line.find(|c: char| !is_word_char(c)).unwrap_or(line.len());
    name_end > 0 && line[name_end..].trim_start().starts_with("::=")
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

#[derive(Debug, Clone, PartialEq)]
enum Item {
    Chars {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Any,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Literal(String),
    Class(Item),
    Ref(String),
    Alt(Vec<Vec<Node>>),
    Repeat(Box<Node>, u32, Option<u32>),
}

/// Most repetitions a `{m,n}` may name: far above a real grammar's, and a bound on what
/// llguidance unrolls.
const MAX_REPEAT: u32 = 10_000;

struct Parser<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<char> {
        self.s[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn line(&self) -> usize {
        self.s[..self.pos].matches('\n').count() + 1
    }

    fn err(&self, msg: impl std::fmt::Display) -> String {
        let rest: String = self.s[self.pos..].chars().take(20).collect();
        format!("line {}: {msg} (at {rest:?})", self.line())
    }

    /// Skips blanks and comments; newlines too where `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => {
                    self.bump();
                }
                '\r' | '\n' if newlines => {
                    self.bump();
                }
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.bump();
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<String, String> {
        let start = self.pos;
        while self.peek().is_some_and(is_word_char) {
            self.bump();
        }
        if self.pos == start {
            return Err(self.err("expected a rule name"));
        }
        Ok(self.s[start..self.pos].to_string())
    }

    /// Whether a rule definition (`name ::=`) starts here.
    fn at_definition(&self) -> bool {
        let rest = &self.s[self.pos..];
        let end = rest.find(|c: char| !is_word_char(c)).unwrap_or(rest.len());
        end > 0
            && rest[end..]
                .trim_start_matches([' ', '\t'])
                .starts_with("::=")
    }

    fn hex(&mut self, digits: usize) -> Result<char, String> {
        let start = self.pos;
        for _ in 0..digits {
            match self.bump() {
                Some(c) if c.is_ascii_hexdigit() => {}
                _ => return Err(self.err(format!("expected {digits} hex digits"))),
            }
        }
        let v = u32::from_str_radix(&self.s[start..self.pos], 16).map_err(|e| self.err(e))?;
        char::from_u32(v).ok_or_else(|| self.err(format!("U+{v:X} is not a character")))
    }

    /// One character of a literal or class, escapes read.
    fn char(&mut self) -> Result<char, String> {
        match self.bump() {
            None => Err(self.err("unexpected end of the grammar")),
            Some('\\') => match self.bump() {
                Some('n') => Ok('\n'),
                Some('r') => Ok('\r'),
                Some('t') => Ok('\t'),
                Some('x') => self.hex(2),
                Some('u') => self.hex(4),
                Some('U') => self.hex(8),
                Some(c @ ('\\' | '"' | '[' | ']' | '-' | '^' | '/')) => Ok(c),
                Some(c) => Err(self.err(format!("unknown escape \\{c}"))),
                None => Err(self.err("unexpected end of the grammar")),
            },
            Some(c) => Ok(c),
        }
    }

    fn literal(&mut self) -> Result<Node, String> {
        self.bump(); // "
        let mut out = String::new();
        loop {
            if self.peek() == Some('"') {
                self.bump();
                return Ok(Node::Literal(out));
            }
            if matches!(self.peek(), None | Some('\n')) {
                return Err(self.err("unterminated string"));
            }
            out.push(self.char()?);
        }
    }

    fn class(&mut self) -> Result<Node, String> {
        self.bump(); // [
        let negated = self.peek() == Some('^');
        if negated {
            self.bump();
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                Some(']') => {
                    self.bump();
                    break;
                }
                None | Some('\n') => return Err(self.err("unterminated character class")),
                _ => {}
            }
            let lo = self.char()?;
            let hi = if self.peek() == Some('-') && !self.s[self.pos + 1..].starts_with(']') {
                self.bump();
                self.char()?
            } else {
                lo
            };
            if hi < lo {
                return Err(self.err(format!("the range {lo:?}-{hi:?} is empty")));
            }
            ranges.push((lo, hi));
        }
        if ranges.is_empty() && !negated {
            return Err(self.err("an empty character class matches nothing"));
        }
        Ok(Node::Class(Item::Chars { negated, ranges }))
    }

    fn int(&mut self) -> Result<u32, String> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.bump();
        }
        let n: u32 = self.s[start..self.pos]
            .parse()
            .map_err(|_| self.err("expected a number"))?;
        if n > MAX_REPEAT {
            return Err(self.err(format!("a repetition of more than {MAX_REPEAT}")));
        }
        Ok(n)
    }

    fn repeat(&mut self, node: Node) -> Result<Node, String> {
        let (lo, hi) = match self.peek() {
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('?') => (0, Some(1)),
            Some('{') => {
                self.bump();
                self.space(true);
                let lo = if self.peek() == Some(',') {
                    0
                } else {
                    self.int()?
                };
                self.space(true);
                let hi = match self.bump() {
                    Some('}') => return Ok(Node::Repeat(Box::new(node), lo, Some(lo))),
                    Some(',') => {
                        self.space(true);
                        let hi = if self.peek() == Some('}') {
                            None
                        } else {
                            Some(self.int()?)
                        };
                        self.space(true);
                        hi
                    }
                    _ => return Err(self.err("expected ',' or '}' in a repetition")),
                };
                if self.peek() != Some('}') {
                    return Err(self.err("expected '}'"));
                }
                if hi.is_some_and(|h| h < lo) {
                    return Err(self.err(format!("the repetition {{{lo},{hi:?}}} is empty")));
                }
                (lo, hi)
            }
            _ => return Ok(node),
        };
        self.bump();
        Ok(Node::Repeat(Box::new(node), lo, hi))
    }

    /// Alternatives up to `)` (nested) or the next rule definition or the end (top).
    fn alternatives(&mut self, nested: bool) -> Result<Vec<Vec<Node>>, String> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.bump();
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<Node>, String> {
        let mut seq = Vec::new();
        loop {
            // A rule may go on over several lines: it ends where the next one starts.
            self.space(true);
            if !nested && self.at_definition() {
                break;
            }
            let node = match self.peek() {
                None | Some('|') | Some(')') => break,
                Some('"') => self.literal()?,
                Some('[') => self.class()?,
                Some('.') => {
                    self.bump();
                    Node::Class(Item::Any)
                }
                Some('(') => {
                    self.bump();
                    self.space(true);
                    let alts = self.alternatives(true)?;
                    if self.bump() != Some(')') {
                        return Err(self.err("expected ')'"));
                    }
                    Node::Alt(alts)
                }
                Some(c) if is_word_char(c) => Node::Ref(self.name()?),
                Some(c) => return Err(self.err(format!("unexpected {c:?}"))),
            };
            self.space(false);
            seq.push(self.repeat(node)?);
        }
        Ok(seq)
    }
}

/// A character inside a regex class, escaped unless it is a letter or digit.
fn class_char(out: &mut String, c: char) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:x}}}", c as u32);
    }
}

/// A Lark string (JSON syntax, control characters and DEL escaped).
fn lark_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn emit(out: &mut String, node: &Node, names: &HashMap<String, String>) {
    match node {
        Node::Literal(s) => lark_string(out, s),
        Node::Class(Item::Any) => out.push_str("/(?s:.)/"),
        Node::Class(Item::Chars { negated, ranges }) => {
            if ranges.is_empty() {
                // `[^]`: any character.
                out.push_str("/(?s:.)/");
                return;
            }
            out.push_str(if *negated { "/[^" } else { "/[" });
            for &(lo, hi) in ranges {
                class_char(out, lo);
                if hi != lo {
                    out.push('-');
                    class_char(out, hi);
                }
            }
            out.push_str("]/");
        }
        Node::Ref(n) => out.push_str(&names[n]),
        Node::Alt(alts) => {
            out.push('(');
            emit_alts(out, alts, names);
            out.push(')');
        }
        Node::Repeat(inner, lo, hi) => {
            // The inner node is atomic: a group is already in parentheses.
            emit(out, inner, names);
            match (lo, hi) {
                (0, None) => out.push('*'),
                (1, None) => out.push('+'),
                (0, Some(1)) => out.push('?'),
                (lo, None) => {
                    let _ = write!(out, "{{{lo},}}");
                }
                (lo, Some(hi)) => {
                    let _ = write!(out, "{{{lo},{hi}}}");
                }
            }
        }
    }
}

fn emit_alts(out: &mut String, alts: &[Vec<Node>], names: &HashMap<String, String>) {
    for (i, seq) in alts.iter().enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        if seq.is_empty() {
            out.push_str("\"\"");
        }
        for (k, n) in seq.iter().enumerate() {
            if k > 0 {
                out.push(' ');
            }
            emit(out, n, names);
        }
    }
}

fn refs<'n>(node: &'n Node, out: &mut Vec<&'n str>) {
    match node {
        Node::Ref(n) => out.push(n),
        Node::Alt(alts) => alts.iter().flatten().for_each(|n| refs(n, out)),
        Node::Repeat(inner, _, _) => refs(inner, out),
        Node::Literal(_) | Node::Class(_) => {}
    }
}

/// The Lark grammar of a GBNF one; an error says what is wrong and on which line.
pub fn to_lark(text: &str) -> Result<String, String> {
    let mut p = Parser { s: text, pos: 0 };
    let mut rules: Vec<(String, Vec<Vec<Node>>)> = Vec::new();
    loop {
        p.space(true);
        if p.peek().is_none() {
            break;
        }
        let line = p.line();
        let name = p.name()?;
        p.space(false);
        if !p.s[p.pos..].starts_with("::=") {
            return Err(p.err(format!("expected ::= after the rule name {name:?}")));
        }
        p.pos += 3;
        let alts = p.alternatives(false)?;
        if p.peek() == Some(')') {
            return Err(p.err("unmatched ')'"));
        }
        if rules.iter().any(|(n, _)| *n == name) {
            return Err(format!("line {line}: the rule {name:?} is defined twice"));
        }
        rules.push((name, alts));
    }
    if !rules.iter().any(|(n, _)| n == "root") {
        return Err("a GBNF grammar needs a rule named root".into());
    }
    // Lark names: lowercase, starting with a letter; `root` is Lark's `start`.
    let mut names: HashMap<String, String> = HashMap::new();
    let mut taken: Vec<String> = vec!["start".into()];
    names.insert("root".into(), "start".into());
    for (n, _) in rules.iter().filter(|(n, _)| n != "root") {
        let mut base: String = n
            .chars()
            .map(|c| {
                if c == '-' {
                    '_'
                } else {
                    c.to_ascii_lowercase()
                }
            })
            .collect();
        if !base.starts_with(|c: char| c.is_ascii_lowercase()) {
            base.insert_str(0, "r_");
        }
        let mut cand = base.clone();
        let mut k = 1;
        while taken.contains(&cand) {
            cand = format!("{base}_{k}");
            k += 1;
        }
        taken.push(cand.clone());
        names.insert(n.clone(), cand);
    }
    for (n, alts) in &rules {
        let mut used = Vec::new();
        alts.iter().flatten().for_each(|x| refs(x, &mut used));
        if let Some(u) = used.iter().find(|u| !names.contains_key(**u)) {
            return Err(format!(
                "the rule {n:?} uses the rule {u:?}, which is not defined"
            ));
        }
    }
    let mut out = String::new();
    for (n, alts) in &rules {
        out.push_str(&names[n]);
        out.push_str(": ");
        emit_alts(&mut out, alts, &names);
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_is_told_from_lark() {
        assert!(is_gbnf("root ::= \"a\""));
        assert!(is_gbnf("# yes or no\n\n  root  ::= \"yes\" | \"no\"\n"));
        assert!(is_gbnf("my-rule::= x\nroot ::= my-rule"));
        assert!(!is_gbnf("start: \"a\""));
        assert!(!is_gbnf("%llguidance {}\nstart: x\nx: \"a\""));
        assert!(!is_gbnf("// a ::= b\nstart: \"::=\""));
        assert!(!is_gbnf(""));
    }

    #[test]
    fn rules_literals_classes_and_repetitions() {
        let g = r#"
# arithmetic
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= num | "(" expr ")"
num    ::= [1-9] [0-9]{0,3} | "0"
"#;
        assert_eq!(
            to_lark(g).unwrap(),
            "start: expr\n\
             expr: term ((\"+\" | \"-\") term)*\n\
             term: num | \"(\" expr \")\"\n\
             num: /[1-9]/ /[0-9]/{0,3} | \"0\"\n"
        );
        let g = "root ::= [^\"\\n] . \"a\\tb\\\"\" x-y?\nx-y ::= \"\\x7f\" |\n  [a-] \"\"";
        assert_eq!(
            to_lark(g).unwrap(),
            "start: /[^\\x{22}\\x{a}]/ /(?s:.)/ \"a\\u0009b\\\"\" x_y?\n\
             x_y: \"\\u007f\" | /[a\\x{2d}]/ \"\"\n"
        );
        // A rule may span lines; the next starts at its `name ::=`.
        let g = "root ::= a\n   a\nStart ::= \"s\"\na ::= Start{2,}";
        assert_eq!(
            to_lark(g).unwrap(),
            "start: a a\nstart_1: \"s\"\na: start_1{2,}\n"
        );
    }

    #[test]
    fn errors_name_the_line_and_the_fault() {
        let e = to_lark("root ::= x").unwrap_err();
        assert!(e.contains("\"x\", which is not defined"), "{e}");
        let e = to_lark("a ::= \"x\"").unwrap_err();
        assert!(e.contains("root"), "{e}");
        let e = to_lark("root ::= \"x\"\nroot ::= \"y\"").unwrap_err();
        assert!(e.contains("line 2") && e.contains("twice"), "{e}");
        let e = to_lark("root ::= \"abc").unwrap_err();
        assert!(e.contains("unterminated string"), "{e}");
        let e = to_lark("root ::= [z-a]").unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let e = to_lark("root ::= (\"a\"").unwrap_err();
        assert!(e.contains("expected ')'"), "{e}");
        let e = to_lark("root ::= \"a\"{3,1}").unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let e = to_lark("root ::= \"a\" ; \"b\"").unwrap_err();
        assert!(e.contains("line 1") && e.contains("';'"), "{e}");
        let e = to_lark("root ::= \"\\q\"").unwrap_err();
        assert!(e.contains("\\q"), "{e}");
    }
}
