package main

import (
	"bufio"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// fuzzTarget is one fuzz function: the package (as the Makefile names it,
// ./internal/x) and the function's name.
type fuzzTarget struct{ pkg, name string }

func (f fuzzTarget) String() string { return f.name + " in " + f.pkg }

// TestMakeFuzzRunsEveryFuzzTarget: `make fuzz` must run every fuzz function
// of the module, and name none that does not exist, so that a fuzz target
// added (or renamed) in a test file is not silently left out of fuzzing.
func TestMakeFuzzRunsEveryFuzzTarget(t *testing.T) {
	root := repoRoot(t)
	inCode := fuzzFuncs(t, root)
	inMake := makeFuzzTargets(t, filepath.Join(root, "Makefile"))
	if len(inCode) == 0 || len(inMake) == 0 {
		t.Fatalf("found %d fuzz functions and %d make fuzz lines: is the scan broken?", len(inCode), len(inMake))
	}
	for _, f := range sortedTargets(inCode) {
		if !inMake[f] {
			t.Errorf("make fuzz does not run %v: add  $(GO) test -run '^$$' -fuzz '^%s$$' -fuzztime $(FUZZTIME) %s", f, f.name, f.pkg)
		}
	}
	for _, f := range sortedTargets(inMake) {
		if !inCode[f] {
			t.Errorf("make fuzz runs %v, which no *_test.go declares", f)
		}
	}
}

func sortedTargets(set map[fuzzTarget]bool) []fuzzTarget {
	return slices.SortedFunc(maps.Keys(set), func(a, b fuzzTarget) int {
		return strings.Compare(a.pkg+" "+a.name, b.pkg+" "+b.name)
	})
}

// fuzzFuncs returns every top-level func FuzzXxx(f *testing.F) of the
// module's *_test.go files, whatever their build tags (go test's rule: the
// name is Fuzz followed by anything but a lower-case letter).
func fuzzFuncs(t *testing.T, root string) map[fuzzTarget]bool {
	t.Helper()
	isFuzz := regexp.MustCompile(`^Fuzz($|[^a-z])`)
	out := map[fuzzTarget]bool{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); path != root && (n == "testdata" || strings.HasPrefix(n, ".") || strings.HasPrefix(n, "_")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		file, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, filepath.Dir(path))
		if err != nil {
			return err
		}
		for _, decl := range file.Decls {
			if fd, ok := decl.(*ast.FuncDecl); ok && fd.Recv == nil && isFuzz.MatchString(fd.Name.Name) {
				out[fuzzTarget{pkg: "./" + filepath.ToSlash(rel), name: fd.Name.Name}] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// makeFuzzLine is one recipe line of the fuzz target:
//
//	$(GO) test -run '^$$' -fuzz '^FuzzXxx$$' -fuzztime $(FUZZTIME) ./pkg
var makeFuzzLine = regexp.MustCompile(`-fuzz '\^(\w+)\$\$' .*\s(\./\S+)\s*$`)

// makeFuzzTargets returns the targets the Makefile's fuzz recipe runs. A
// recipe line that mentions -fuzz but cannot be read fails the test, so a
// typo there is not mistaken for a missing target.
func makeFuzzTargets(t *testing.T, makefile string) map[fuzzTarget]bool {
	t.Helper()
	f, err := os.Open(makefile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[fuzzTarget]bool{}
	inFuzz := false
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if !strings.HasPrefix(line, "\t") {
			inFuzz = strings.HasPrefix(line, "fuzz:")
			continue
		}
		if !inFuzz || !strings.Contains(line, "-fuzz") {
			continue
		}
		m := makeFuzzLine.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("Makefile:%d: a fuzz line not of the form -fuzz '^FuzzXxx$$' ... ./pkg: %q", n, line)
		}
		out[fuzzTarget{pkg: m[2], name: m[1]}] = true
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}
