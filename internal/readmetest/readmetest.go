// Package readmetest checks that the Go in a Markdown file (README.md) is
// real: every ```go block compiles against the module as it is, and every
// inline code span that names an API of the module's packages names one that
// exists and is used as it can be.
//
// # Blocks
//
// All ```go blocks of a file are compiled together, in order, as one
// package inside the module, so a later block may use what an earlier one
// declares. A block that parses as top-level declarations is a file of its
// own; any other block is the body of a function. Imports are added from
// the package names a block uses (see [imports]); a block lists none.
//
// Conventions, for fragments:
//
//   - `{ ... }` stands for code left out (handle the error) and compiles as
//     an empty block.
//   - A comment `<!-- go:func(ctx context.Context, id string) -->` on the
//     last line before a block gives the parameters of the function that a
//     statement block becomes: the variables it takes from its surroundings.
//   - A comment that starts with `<!-- go:stub` and ends with `-->` holds
//     declarations compiled with the blocks but not shown: the user's own
//     functions and services a snippet calls.
//
// Errors are reported at the file's own lines (through //line directives).
//
// # Inline code
//
// An inline code span outside the blocks that parses as a Go expression or
// statement (once each `...` is read as nil) is checked without compiling it: a
// qualified name pkg.Name of one of the module's packages must exist, must
// not be called if it is a type, and, if it is a function returning more
// than one result, must not have a method called on its result; a method or
// field named on a well-known variable ([receivers], such as engine) must
// exist; keyed fields of pkg.Type{...} literals must exist.
package readmetest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Module is the module whose packages the snippets use.
const Module = "github.com/sagaflow/sagaflow"

// imports maps the package names a snippet may use to their import paths.
var imports = map[string]string{
	"context":     "context",
	"errors":      "errors",
	"fmt":         "fmt",
	"http":        "net/http",
	"json":        "encoding/json",
	"log":         "log",
	"os":          "os",
	"slog":        "log/slog",
	"strings":     "strings",
	"time":        "time",
	"pgx":         "github.com/jackc/pgx/v5",
	"pgxpool":     "github.com/jackc/pgx/v5/pgxpool",
	"uuid":        "github.com/google/uuid",
	"kafka":       "github.com/segmentio/kafka-go",
	"saga":        Module + "/saga",
	"steps":       Module + "/steps",
	"migrations":  Module + "/migrations",
	"outbox":      Module + "/outbox",
	"relay":       Module + "/relay",
	"inbox":       Module + "/inbox",
	"idempotency": Module + "/idempotency",
	"kafkaconfig": Module + "/kafkaconfig",
}

// packages are the module's packages whose names inline code is checked
// against.
var packages = []string{"saga", "steps", "migrations", "outbox", "relay", "inbox", "idempotency", "kafkaconfig"}

// receivers are variables that prose names without declaring them, with
// their types, for the inline check.
var receivers = map[string]string{
	"engine": "saga.Engine",
	"run":    "saga.StepRun",
	"idem":   "idempotency.Middleware",
}

// Block is a ```go block.
type Block struct {
	Line   int    // of its first line of code, 1-based
	Code   string // with `{ ... }` already made compilable
	Params string // from a go:func comment, without the parentheses
}

// Stub is the Go code of a go:stub comment.
type Stub struct {
	Line int
	Code string
}

// Span is an inline code span outside the blocks.
type Span struct {
	Line int
	Code string
}

// Doc is what [Parse] found in a Markdown file.
type Doc struct {
	Name   string // the file's name, for error positions
	Blocks []Block
	Stubs  []Stub
	Spans  []Span
}

var (
	elided     = regexp.MustCompile(`\{ \.\.\. \}`)
	inlineCode = regexp.MustCompile("`([^`]+)`")
	funcParams = regexp.MustCompile(`^<!--\s*go:func\((.*)\)\s*-->$`)
)

// Parse finds the Go blocks, stubs and inline code spans of a Markdown file.
func Parse(name string, md []byte) (*Doc, error) {
	d := &Doc{Name: name}
	lines := strings.Split(string(md), "\n")
	params := "" // from the last go:func comment, for the next block
	for i := 0; i < len(lines); i++ {
		line := lines[i]
		trimmed := strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(trimmed, "```"):
			lang := strings.TrimSpace(strings.TrimPrefix(trimmed, "```"))
			start := i + 1
			for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			}
			if i == len(lines) {
				return nil, fmt.Errorf("%s:%d: code block not closed", name, start)
			}
			if lang == "go" {
				code := strings.Join(lines[start:i], "\n")
				d.Blocks = append(d.Blocks, Block{Line: start + 1, Code: elided.ReplaceAllString(code, "{}"), Params: params})
			}
			params = ""
		case strings.HasPrefix(trimmed, "<!-- go:stub"):
			start := i + 1
			for ; i < len(lines) && !strings.Contains(lines[i], "-->"); i++ {
			}
			if i == len(lines) || strings.TrimSpace(lines[i]) != "-->" {
				return nil, fmt.Errorf("%s:%d: a go:stub comment ends with a line of its own: -->", name, start)
			}
			d.Stubs = append(d.Stubs, Stub{Line: start + 1, Code: strings.Join(lines[start:i], "\n")})
		case strings.HasPrefix(trimmed, "<!-- go:"):
			m := funcParams.FindStringSubmatch(trimmed)
			if m == nil {
				return nil, fmt.Errorf("%s:%d: unknown directive %s", name, i+1, trimmed)
			}
			params = m[1]
		default:
			for _, m := range inlineCode.FindAllStringSubmatch(line, -1) {
				d.Spans = append(d.Spans, Span{Line: i + 1, Code: m[1]})
			}
		}
	}
	return d, nil
}

// Compile writes the blocks and stubs as one package inside the module at
// root (through an overlay: nothing is written to the module) and builds it
// with the go command. It returns the compiler's errors, at the Markdown
// file's lines.
func Compile(ctx context.Context, root string, d *Doc) error {
	tmp, err := os.MkdirTemp("", "readmetest")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	files := map[string]string{}
	for i, s := range d.Stubs {
		src, err := withImports(fmt.Sprintf("//line %s:%d\n%s\n", d.Name, s.Line, s.Code), d.Name, s.Line)
		if err != nil {
			return err
		}
		files[fmt.Sprintf("stub%d.go", i)] = src
	}
	for i, b := range d.Blocks {
		var body string
		if _, err := parser.ParseFile(token.NewFileSet(), "", "package readme\n"+b.Code, parser.SkipObjectResolution); err == nil {
			body = fmt.Sprintf("//line %s:%d\n%s\n", d.Name, b.Line, b.Code)
		} else {
			body = fmt.Sprintf("func snippet%d(%s) {\n//line %s:%d\n%s\n}\n", i, b.Params, d.Name, b.Line, b.Code)
		}
		src, err := withImports(body, d.Name, b.Line)
		if err != nil {
			return err
		}
		files[fmt.Sprintf("block%d.go", i)] = src
	}
	pkgDir := filepath.Join(root, "internal", "readmetest", "readme")
	overlay := map[string]map[string]string{"Replace": {}}
	for name, src := range files {
		path := filepath.Join(tmp, name)
		if err := os.WriteFile(path, []byte(src), 0o600); err != nil {
			return err
		}
		overlay["Replace"][filepath.Join(pkgDir, name)] = path
	}
	js, err := json.Marshal(overlay)
	if err != nil {
		return err
	}
	overlayPath := filepath.Join(tmp, "overlay.json")
	if err := os.WriteFile(overlayPath, js, 0o600); err != nil {
		return err
	}
	goCmd, err := exec.LookPath("go")
	if err != nil {
		return fmt.Errorf("readmetest: the go command is needed: %w", err)
	}
	cmd := exec.CommandContext(ctx, goCmd, "build", "-overlay="+overlayPath, "./internal/readmetest/readme")
	cmd.Dir = root
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("readmetest: the Go blocks of %s do not compile: %w\n%s", d.Name, err, out.String())
	}
	return nil
}

// withImports returns the file "package readme" with body and the imports
// for the package names that body uses without declaring them.
func withImports(body, name string, line int) (string, error) {
	f, err := parser.ParseFile(token.NewFileSet(), "", "package readme\n"+body, 0)
	if err != nil {
		return "", fmt.Errorf("%s:%d: the Go does not parse: %w", name, line, err)
	}
	used := map[string]bool{}
	for _, id := range f.Unresolved { // names this file does not declare
		if path, ok := imports[id.Name]; ok {
			used[path] = true
		}
	}
	paths := make([]string, 0, len(used))
	for p := range used {
		paths = append(paths, strconv.Quote(p))
	}
	sort.Strings(paths)
	head := "package readme\n"
	if len(paths) > 0 {
		head += "\nimport (\n\t" + strings.Join(paths, "\n\t") + "\n)\n"
	}
	return head + "\n" + body, nil
}

// Index is what the module's packages declare, for the inline check.
type Index struct {
	// objects maps "pkg.Name" to its kind: "func", "type", "var" or "const".
	objects map[string]string
	// results maps "pkg.Func" and "pkg.Type.Method" to the number of
	// results.
	results map[string]int
	// members maps "pkg.Type" to the names of its fields and methods.
	members map[string]map[string]bool
}

// Load indexes the exported API of the module's packages under root, from
// their source (test files left out).
func Load(root string) (*Index, error) {
	ix := &Index{objects: map[string]string{}, results: map[string]int{}, members: map[string]map[string]bool{}}
	member := func(typ, name string) {
		if ix.members[typ] == nil {
			ix.members[typ] = map[string]bool{}
		}
		ix.members[typ][name] = true
	}
	for _, pkg := range packages {
		files, err := filepath.Glob(filepath.Join(root, pkg, "*.go"))
		if err != nil {
			return nil, err
		}
		fset := token.NewFileSet()
		for _, path := range files {
			if strings.HasSuffix(path, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
			if err != nil {
				return nil, err
			}
			for _, decl := range f.Decls {
				switch decl := decl.(type) {
				case *ast.FuncDecl:
					n := decl.Type.Results.NumFields()
					if decl.Recv == nil {
						ix.objects[pkg+"."+decl.Name.Name] = "func"
						ix.results[pkg+"."+decl.Name.Name] = n
						continue
					}
					typ := pkg + "." + recvType(decl.Recv.List[0].Type)
					member(typ, decl.Name.Name)
					ix.results[typ+"."+decl.Name.Name] = n
				case *ast.GenDecl:
					for _, spec := range decl.Specs {
						switch spec := spec.(type) {
						case *ast.TypeSpec:
							ix.objects[pkg+"."+spec.Name.Name] = "type"
							if st, ok := spec.Type.(*ast.StructType); ok {
								for _, field := range st.Fields.List {
									for _, n := range field.Names {
										member(pkg+"."+spec.Name.Name, n.Name)
									}
									if len(field.Names) == 0 {
										member(pkg+"."+spec.Name.Name, recvType(field.Type))
									}
								}
							}
						case *ast.ValueSpec:
							kind := "var"
							if decl.Tok == token.CONST {
								kind = "const"
							}
							for _, n := range spec.Names {
								ix.objects[pkg+"."+n.Name] = kind
							}
						}
					}
				}
			}
		}
	}
	return ix, nil
}

// recvType is the name of a receiver or embedded type: T in T, *T, T[P],
// pkg.T.
func recvType(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.StarExpr:
		return recvType(e.X)
	case *ast.IndexExpr:
		return recvType(e.X)
	case *ast.IndexListExpr:
		return recvType(e.X)
	case *ast.SelectorExpr:
		return e.Sel.Name
	case *ast.Ident:
		return e.Name
	}
	return ""
}

// CheckSpans checks the inline code spans of d against ix and returns one
// error per problem, at the Markdown file's lines.
func CheckSpans(ix *Index, d *Doc) []error {
	var errs []error
	for _, s := range d.Spans {
		code := strings.ReplaceAll(s.Code, "...", "nil")
		var node ast.Node
		if e, err := parser.ParseExpr(code); err == nil {
			node = e
		} else if f, err := parser.ParseFile(token.NewFileSet(), "", "package p\nfunc _() {\n"+code+"\n}", parser.SkipObjectResolution); err == nil {
			node = f
		} else {
			continue // prose, a command, a path: not Go
		}
		for _, problem := range ix.check(node) {
			errs = append(errs, fmt.Errorf("%s:%d: `%s`: %s", d.Name, s.Line, s.Code, problem))
		}
	}
	return errs
}

// qualified returns "pkg.Name" when e is a selector on one of the module's
// package names (or a receiver's type, with ok false for receivers).
func qualified(e ast.Expr) (string, bool) {
	sel, ok := e.(*ast.SelectorExpr)
	if !ok {
		return "", false
	}
	id, ok := sel.X.(*ast.Ident)
	if !ok {
		return "", false
	}
	for _, p := range packages {
		if id.Name == p {
			return p + "." + sel.Sel.Name, true
		}
	}
	return "", false
}

func (ix *Index) check(node ast.Node) []string {
	var problems []string
	ast.Inspect(node, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.SelectorExpr:
			if name, ok := qualified(n); ok {
				if _, exists := ix.objects[name]; !exists {
					problems = append(problems, name+" does not exist")
				}
				return true
			}
			if id, ok := n.X.(*ast.Ident); ok {
				if typ, ok := receivers[id.Name]; ok && !ix.members[typ][n.Sel.Name] {
					problems = append(problems, fmt.Sprintf("%s (a %s) has no field or method %s", id.Name, typ, n.Sel.Name))
				}
			}
			if call, ok := n.X.(*ast.CallExpr); ok {
				if name, ok := qualified(call.Fun); ok && ix.objects[name] == "func" && ix.results[name] > 1 {
					problems = append(problems, fmt.Sprintf("%s returns %d results: .%s cannot be called on them", name, ix.results[name], n.Sel.Name))
				}
			}
		case *ast.CallExpr:
			if name, ok := qualified(n.Fun); ok && ix.objects[name] == "type" {
				problems = append(problems, name+" is a type, not a function")
			}
		case *ast.CompositeLit:
			typ, ok := qualified(unindex(n.Type))
			if !ok || ix.objects[typ] != "type" {
				return true
			}
			for _, elt := range n.Elts {
				var field string
				switch elt := elt.(type) {
				case *ast.KeyValueExpr:
					if id, ok := elt.Key.(*ast.Ident); ok {
						field = id.Name
					}
				case *ast.Ident: // prose lists a struct's fields as {A, B}
					if elt.Name != "nil" { // what stood for "..."
						field = elt.Name
					}
				}
				if field != "" && !ix.members[typ][field] {
					problems = append(problems, fmt.Sprintf("%s has no field %s", typ, field))
				}
			}
		}
		return true
	})
	return problems
}

func unindex(e ast.Expr) ast.Expr {
	switch x := e.(type) {
	case *ast.IndexExpr:
		return x.X
	case *ast.IndexListExpr:
		return x.X
	}
	return e
}

// ModuleRoot returns the directory of the go.mod above dir.
func ModuleRoot(dir string) (string, error) {
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", errors.New("readmetest: no go.mod above " + dir)
		}
	}
}
