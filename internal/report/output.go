package report

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Outputs is where a result goes besides the terminal table: the one writer of
// `kvgate bench`, `kvgate demo` and `kvgate replay`.
type Outputs struct {
	JSON      string  // file for WriteJSON; "" for none
	ReportDir string  // directory for WriteReport; "" for none
	Title     string  // the report's title
	Charts    []Chart // the report's extra charts
	// Verdict opens the table and the report with Decide's verdict: set when the runs are
	// policies compared on one workload (not a sweep of one policy's settings).
	Verdict bool
}

// Write writes res as a table to table (after the verdict, when asked), then
// the JSON file and the report directory when asked, and names each file
// written on log. The JSON is encoded before the file is created, so that an
// unencodable result leaves no partial file.
func (o Outputs) Write(table, log io.Writer, res Result) error {
	var verdict *Verdict
	if v, ok := Decide(res); o.Verdict && ok {
		verdict = &v
		chart := ""
		if o.ReportDir != "" {
			chart = filepath.Join(o.ReportDir, v.Chart+".svg")
		}
		WriteVerdict(table, v, chart)
	}
	WriteTable(table, res)
	if o.JSON != "" {
		var b bytes.Buffer
		if err := WriteJSON(&b, res); err != nil {
			return err
		}
		if err := os.WriteFile(o.JSON, b.Bytes(), 0o644); err != nil {
			return fmt.Errorf("report: %w", err)
		}
		fmt.Fprintf(log, "JSON: %s\n", o.JSON)
	}
	if o.ReportDir != "" {
		if err := writeReport(o.ReportDir, res, o.Title, verdict, o.Charts); err != nil {
			return err
		}
		fmt.Fprintf(log, "Report: %s\n", filepath.Join(o.ReportDir, "index.html"))
	}
	return nil
}
