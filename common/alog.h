/* alog.h - the access log's sink (SPEC 11): whole lines copied into a bounded in-memory ring by any thread and
 * written out in batches by a writer thread of its own, to stderr or a file (reopened on request, the logrotate
 * habit). A caller never waits for a disk or a pipe: a line that does not fit in the ring, or whose batch could not
 * be written, is dropped and counted. Also the log format every log line is written in (cm_log). Never calls another
 * room. */
#ifndef IDEMGATE_ALOG_H
#define IDEMGATE_ALOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

/* The longest access line (longer ones are cut at a field boundary by the formatter, never split). */
#define CM_ALOG_LINE_MAX 4096

/* Opens the sink: dest is "stderr", "off" or a file path (opened O_APPEND|O_CREAT, 0640) and starts the writer
 * thread. Returns false with *err (heap, caller frees) when the file cannot be opened or the thread not started.
 * Call once at start, before any request. */
bool cm_alog_open(const char *dest, char **err) CM_MUST_CHECK;
/* Whether lines are wanted (opened and not "off"): a caller formats nothing otherwise. Any thread. */
bool cm_alog_enabled(void);
/* Queues one line (with its '\n') for the writer; drops and counts it when the ring has no room. Any thread. */
void cm_alog_write(const char *line, size_t n);
/* Asks the writer to reopen the file (SIGUSR1): lines after that go to the file now at the path. */
void cm_alog_reopen(void);
/* Lines dropped since start (idemgate_log_dropped_total). */
uint64_t cm_alog_dropped(void);
/* Writes what the ring holds (bounded wait) and stops the writer; the sink is off afterwards. */
void cm_alog_close(void);

/* Writes one access line: the usual head (ts, level=info, event=access), then fields (logfmt "k=v k=v", without
 * '\n'), in the log format (cm_log_get_format); cut at CM_ALOG_LINE_MAX. Nothing when the sink is off. */
void cm_alog_line(const char *fields, size_t n);

#endif
