/* First-fit packing of one pass over a stream of examples, the rule of
   seq2seq/data/pipeline.py's `_first_fit_rows` (its Python form, and the reference): each
   example goes into the oldest of the `window` most recently started rows where both its
   source and its target still fit, or else starts a new row, which closes the oldest row
   when `window` rows are open. Rows are numbered in the order they start, which is also the
   order they close.

   src_len, tgt_len: the examples' lengths in arrival order (each at most seq_len).
   row:              out: the row of each example, -1 for the examples after the pass ended.
   Ends once `max_rows` rows are closed (the example that would start row max_rows + window
   is not placed); returns the number of rows started. */
#include <stdint.h>
#include <string.h>

int64_t seq2seq_first_fit(const int32_t *src_len, const int32_t *tgt_len, int64_t n,
                          int32_t seq_len, int32_t window, int64_t max_rows, int32_t *row) {
  int32_t room_src[256], room_tgt[256];   /* open rows, oldest first */
  int32_t id[256];
  int32_t open = 0;
  int64_t started = 0, i = 0;
  if (window < 1 || window > 256) return -1;
  for (; i < n; i++) {
    const int32_t s = src_len[i], t = tgt_len[i];
    int32_t j = 0;
    while (j < open && (room_src[j] < s || room_tgt[j] < t)) j++;
    if (j < open) {
      room_src[j] -= s;
      room_tgt[j] -= t;
      row[i] = id[j];
      continue;
    }
    if (open == window) {                 /* the oldest row closes */
      if (started - window + 1 == max_rows) break;
      memmove(room_src, room_src + 1, (size_t)(window - 1) * sizeof room_src[0]);
      memmove(room_tgt, room_tgt + 1, (size_t)(window - 1) * sizeof room_tgt[0]);
      memmove(id, id + 1, (size_t)(window - 1) * sizeof id[0]);
      open--;
    }
    room_src[open] = seq_len - s;
    room_tgt[open] = seq_len - t;
    id[open++] = (int32_t)started;
    row[i] = (int32_t)started++;
  }
  for (; i < n; i++) row[i] = -1;
  return started;
}
