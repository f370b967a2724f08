#include "scheduler/finetune/jsonl_check.h"

#include "models/train/dataset.h"

namespace kiln::finetune {

Status CheckFineTuneJsonl(std::string_view text, std::string_view name) {
  // "name: line 7" rather than training's "name:7": this message goes to an API client, who
  // reads it in a JSON error, not next to a path in a log.
  return WithParam(models::train::ForEachJsonlLine(text, name,
                                                   [&](int64_t line_no, std::string_view line) {
                                                     return models::train::CheckExampleLine(
                                                         line, StrCat(name, ": line ", line_no));
                                                   }),
                   "file");
}

}  // namespace kiln::finetune
