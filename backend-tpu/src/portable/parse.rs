//! A reader of the MLIR text kiln's lowering writes (Note [Portable
//! artifacts]): a `module` of `func.func`s whose bodies are operations in the
//! generic form, `%r = "dialect.op"(%a, %b) ({regions}) {attrs} : (types) ->
//! types`. Attributes and types stay text; the conversion to VHLO reads them.
//! Anything else (a custom op's function body in a dialect's own syntax) is
//! refused with the place it stopped.

/// A parsed module.
#[derive(Debug)]
pub(crate) struct Module {
    /// The module's attributes, `name = value` as written, and its name as
    /// `sym_name`.
    pub attrs: Vec<(String, String)>,
    pub funcs: Vec<Func>,
}

/// A `func.func`.
#[derive(Debug)]
pub(crate) struct Func {
    pub name: String,
    pub public: bool,
    /// Argument names and types.
    pub args: Vec<(String, String)>,
    /// Each argument's attributes (`{tf.aliasing_output = 0 : i32}`).
    pub arg_attrs: Vec<Vec<(String, String)>>,
    pub results: Vec<String>,
    pub body: Vec<Op>,
}

/// An operation in the generic form (StableHLO as parsed, VHLO once
/// converted).
#[derive(Debug)]
pub(crate) struct Op {
    /// The values it defines: `%v` or, for `%v:2`, `%v#0` and `%v#1`.
    pub results: Vec<String>,
    pub name: String,
    pub operands: Vec<String>,
    pub regions: Vec<Region>,
    pub attrs: Vec<(String, String)>,
    pub result_types: Vec<String>,
}

/// A region of one block.
#[derive(Debug)]
pub(crate) struct Region {
    pub args: Vec<(String, String)>,
    pub ops: Vec<Op>,
}

/// Parses `text`; an error names what was expected and the text there.
pub(crate) fn module(text: &str) -> Result<Module, String> {
    let mut p = Parser { s: text.as_bytes(), i: 0, depth: 0 };
    p.keyword("module")?;
    let mut attrs = Vec::new();
    if p.peek() == Some(b'@') {
        attrs.push(("sym_name".to_string(), format!("\"{}\"", p.symbol()?)));
    }
    if p.try_keyword("attributes") {
        attrs.extend(p.attr_dict()?);
    }
    p.expect(b'{')?;
    let mut funcs = Vec::new();
    while !p.try_byte(b'}') {
        funcs.push(p.func()?)
    }
    p.ws();
    if p.i != p.s.len() {
        return Err(p.error("the end of the module"));
    }
    Ok(Module { attrs, funcs })
}

/// Regions nest at most this deep (kiln's programs nest a few levels; the
/// bound keeps the recursive reader and writer off the stack's end).
const MAX_DEPTH: usize = 64;

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    /// Regions open at the current position.
    depth: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.i).copied()
    }

    fn error(&self, want: &str) -> String {
        let end = (self.i + 60).min(self.s.len());
        let here = String::from_utf8_lossy(&self.s[self.i.min(end)..end]);
        format!("expected {want} at byte {}, found {here:?}", self.i)
    }

    fn try_byte(&mut self, b: u8) -> bool {
        if self.peek() == Some(b) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, b: u8) -> Result<(), String> {
        if self.try_byte(b) {
            Ok(())
        } else {
            Err(self.error(&format!("'{}'", b as char)))
        }
    }

    fn try_str(&mut self, t: &str) -> bool {
        self.ws();
        if self.s[self.i..].starts_with(t.as_bytes()) {
            self.i += t.len();
            true
        } else {
            false
        }
    }

    fn try_keyword(&mut self, k: &str) -> bool {
        self.ws();
        let rest = &self.s[self.i..];
        let ends = rest.get(k.len()).is_none_or(|c| !(c.is_ascii_alphanumeric() || *c == b'_' || *c == b'.'));
        if rest.starts_with(k.as_bytes()) && ends {
            self.i += k.len();
            true
        } else {
            false
        }
    }

    fn keyword(&mut self, k: &str) -> Result<(), String> {
        if self.try_keyword(k) {
            Ok(())
        } else {
            Err(self.error(&format!("`{k}`")))
        }
    }

    /// An identifier after a sigil (`%v1`, `@main`, `^bb0`, an attribute name).
    fn ident(&mut self) -> String {
        let start = self.i;
        while self.i < self.s.len() && (self.s[self.i].is_ascii_alphanumeric() || b"_.$-".contains(&self.s[self.i])) {
            self.i += 1;
        }
        String::from_utf8_lossy(&self.s[start..self.i]).into_owned()
    }

    fn symbol(&mut self) -> Result<String, String> {
        self.expect(b'@')?;
        let name = self.ident();
        if name.is_empty() {
            return Err(self.error("a symbol name"));
        }
        Ok(name)
    }

    fn value(&mut self) -> Result<String, String> {
        self.expect(b'%')?;
        let mut name = format!("%{}", self.ident());
        if self.s.get(self.i) == Some(&b'#') {
            self.i += 1;
            name.push('#');
            name.push_str(&self.ident());
        }
        if name.len() == 1 {
            return Err(self.error("a value name"));
        }
        Ok(name)
    }

    /// Text up to (not including) the first of `stops` outside brackets and
    /// string literals, trimmed.
    fn balanced(&mut self, stops: &[u8]) -> Result<String, String> {
        self.ws();
        let start = self.i;
        let mut depth = 0i32;
        while self.i < self.s.len() {
            let c = self.s[self.i];
            if depth == 0 && stops.contains(&c) {
                break;
            }
            match c {
                b'"' => {
                    self.i += 1;
                    while self.i < self.s.len() && self.s[self.i] != b'"' {
                        self.i += if self.s[self.i] == b'\\' { 2 } else { 1 };
                    }
                }
                b'<' | b'[' | b'(' | b'{' => depth += 1,
                // `->` is not a closing bracket.
                b'>' if self.i > 0 && self.s[self.i - 1] == b'-' => {}
                b'>' | b']' | b')' | b'}' => {
                    depth -= 1;
                    if depth < 0 {
                        return Err(self.error("balanced brackets"));
                    }
                }
                _ => {}
            }
            self.i += 1;
        }
        if self.i >= self.s.len() {
            return Err(self.error("the end of an attribute or type"));
        }
        Ok(String::from_utf8_lossy(&self.s[start..self.i]).trim().to_string())
    }

    /// `{name = value, ...}`.
    fn attr_dict(&mut self) -> Result<Vec<(String, String)>, String> {
        self.expect(b'{')?;
        let mut out = Vec::new();
        if self.try_byte(b'}') {
            return Ok(out);
        }
        loop {
            self.ws();
            let name = self.ident();
            if name.is_empty() {
                return Err(self.error("an attribute name"));
            }
            self.expect(b'=')?;
            out.push((name, self.balanced(b",}")?));
            if self.try_byte(b'}') {
                return Ok(out);
            }
            self.expect(b',')?;
        }
    }

    /// `(t, t)` or a single type.
    fn types(&mut self) -> Result<Vec<String>, String> {
        if self.try_byte(b'(') {
            let mut out = Vec::new();
            if self.try_byte(b')') {
                return Ok(out);
            }
            loop {
                out.push(self.balanced(b",)")?);
                if self.try_byte(b')') {
                    return Ok(out);
                }
                self.expect(b',')?;
            }
        }
        Ok(vec![self.balanced(b",{}\n")?])
    }

    /// `(%a: t {attrs}?, ...)`: names, types and attributes.
    #[allow(clippy::type_complexity)]
    fn args(&mut self) -> Result<(Vec<(String, String)>, Vec<Vec<(String, String)>>), String> {
        self.expect(b'(')?;
        let (mut out, mut attrs) = (Vec::new(), Vec::new());
        if self.try_byte(b')') {
            return Ok((out, attrs));
        }
        loop {
            let name = self.value()?;
            self.expect(b':')?;
            out.push((name, self.balanced(b",){")?));
            attrs.push(if self.peek() == Some(b'{') { self.attr_dict()? } else { vec![] });
            if self.try_byte(b')') {
                return Ok((out, attrs));
            }
            self.expect(b',')?;
        }
    }

    fn func(&mut self) -> Result<Func, String> {
        self.keyword("func.func")?;
        let public = if self.try_keyword("private") {
            false
        } else {
            self.try_keyword("public");
            true
        };
        let name = self.symbol()?;
        let (args, arg_attrs) = self.args()?;
        let results = if self.try_str("->") { self.types()? } else { vec![] };
        self.expect(b'{')?;
        let mut body = Vec::new();
        while !self.try_byte(b'}') {
            body.push(self.op()?);
        }
        Ok(Func { name, public, args, arg_attrs, results, body })
    }

    fn op(&mut self) -> Result<Op, String> {
        let mut results = Vec::new();
        if self.peek() == Some(b'%') {
            let name = self.value()?;
            if self.try_byte(b':') {
                let n: usize = self.ident().parse().map_err(|_| self.error("a result count"))?;
                // Each result has a type in the text: a count beyond its length is malformed.
                if n > self.s.len() {
                    return Err(self.error("a result count within the text's length"));
                }
                results.extend((0..n).map(|k| format!("{name}#{k}")));
            } else {
                results.push(name);
            }
            self.expect(b'=')?;
        }
        if !self.try_byte(b'"') {
            return Err(self.error(
                "an op in the generic form, `\"dialect.op\"(..)` (a custom op's StableHLO written in the pretty form has no portable artifact)",
            ));
        }
        let name = self.ident();
        self.expect(b'"')?;
        self.expect(b'(')?;
        let mut operands = Vec::new();
        if !self.try_byte(b')') {
            loop {
                operands.push(self.value()?);
                if self.try_byte(b')') {
                    break;
                }
                self.expect(b',')?;
            }
        }
        let mut regions = Vec::new();
        if self.peek() == Some(b'(') {
            self.i += 1;
            loop {
                regions.push(self.region()?);
                if self.try_byte(b')') {
                    break;
                }
                self.expect(b',')?;
            }
        }
        let attrs = if self.peek() == Some(b'{') { self.attr_dict()? } else { vec![] };
        self.expect(b':')?;
        let operand_types = self.types()?;
        if !self.try_str("->") {
            return Err(self.error("`->`"));
        }
        let result_types = self.types()?;
        if result_types.len() != results.len() {
            return Err(format!("{name} defines {} values but has {} result types", results.len(), result_types.len()));
        }
        if operand_types.len() != operands.len() {
            return Err(format!("{name} has {} operands but {} operand types", operands.len(), operand_types.len()));
        }
        Ok(Op { results, name, operands, regions, attrs, result_types })
    }

    fn region(&mut self) -> Result<Region, String> {
        if self.depth == MAX_DEPTH {
            return Err(self.error(&format!("regions nested at most {MAX_DEPTH} deep")));
        }
        self.depth += 1;
        let r = self.region_body();
        self.depth -= 1;
        r
    }

    fn region_body(&mut self) -> Result<Region, String> {
        self.expect(b'{')?;
        let mut args = Vec::new();
        if self.peek() == Some(b'^') {
            self.i += 1;
            self.ident();
            if self.peek() == Some(b'(') {
                let (a, attrs) = self.args()?;
                if attrs.iter().any(|a| !a.is_empty()) {
                    return Err(self.error("block arguments without attributes"));
                }
                args = a;
            }
            self.expect(b':')?;
        }
        let mut ops = Vec::new();
        while !self.try_byte(b'}') {
            if self.peek() == Some(b'^') {
                return Err(self.error("a region of one block"));
            }
            ops.push(self.op()?);
        }
        Ok(Region { args, ops })
    }
}
